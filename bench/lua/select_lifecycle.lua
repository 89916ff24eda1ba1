-- The selection service's request lifecycle: /select_and_reserve, then the reservation's
-- prefill_complete, output_block and DELETE, each selection id exactly once per route.
--   wrk -t1 -s select_lifecycle.lua URL -- <run id> <bodies file> <lag> <latency file>
--
-- As lua/lifecycle.lua: step k sends select_and_reserve(k), then prefill_complete(k - lag) and
-- output_block(k - lag), then DELETE(k - 2*lag); with lag far above the connection count the
-- selection has long been answered, so no call finds its reservation missing (a 404 would
-- show as a status error). The bodies file holds one /select_and_reserve body per line (a JSON
-- object without its selection id), sent in turn.
--
-- extra_report prints `step`: the suite frees the reservations a run left behind, ids
-- run_id-(step - 2*lag - 1) to run_id-step. On one connection, where each answer belongs to the
-- request sent last, every answer's latency (request() to response(), microseconds) is written
-- with its route to the latency file (the mix's own percentiles mix four routes); a request
-- built while another is unanswered shows several connections, and stops the record
-- ("timed": false). The file, not thread:get, carries the samples: wrk 4.1 copies a table
-- between Lua states wrongly (it pops one value too many, and crashed here).
local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clock_id, bench_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local now_ts = ffi.new("bench_timespec")

local function now_us()
   ffi.C.clock_gettime(CLOCK_MONOTONIC, now_ts)
   return tonumber(now_ts.tv_sec) * 1e6 + tonumber(now_ts.tv_nsec) / 1e3
end

local run_id, prefixes, lag, latency_file
step, overlapped = 0, false  -- globals: extra_report reads them from the thread
local phase = 0
local primed = false  -- wrk builds one request more than it sends (see lua/lifecycle.lua)
local sent_route, sent_at = nil, 0
local json = { ["Content-Type"] = "application/json" }

function init(args)
   run_id, lag = args[1], tonumber(args[3])
   latency_file = assert(io.open(args[4], "w"))
   prefixes = {}
   for line in io.lines(args[2]) do
      prefixes[#prefixes + 1] = line:sub(1, -2) .. ',"selection_id":"'  -- the object without its "}"
   end
end

local function id(k)
   return run_id .. "-" .. k
end

local function sent(route, request)
   if sent_route then overlapped = true end  -- the last request is unanswered: several connections
   sent_route, sent_at = route, now_us()
   return request
end

function request()
   if not primed then
      primed = true
      return wrk.format("GET", "/health")
   end
   while true do
      local k = step
      if phase == 0 then
         phase = 1
         local body = prefixes[k % #prefixes + 1] .. id(k) .. '"}'
         return sent("select_and_reserve", wrk.format("POST", "/select_and_reserve", json, body))
      elseif phase == 1 then
         phase = 2
         -- No body, as Dynamo's own examples call it (Content-Length: 0).
         if k >= lag then
            return sent("prefill_complete", wrk.format("POST", "/reservations/" .. id(k - lag) .. "/prefill_complete",
               nil, ""))
         end
      elseif phase == 2 then
         phase = 3
         -- Dynamo answers 415 to an output_block without a JSON body: `{}` is the least it takes.
         if k >= lag then
            return sent("output_block", wrk.format("POST", "/reservations/" .. id(k - lag) .. "/output_block",
               json, "{}"))
         end
      else
         phase, step = 0, step + 1
         if k >= 2 * lag then
            return sent("free", wrk.format("DELETE", "/reservations/" .. id(k - 2 * lag)))
         end
      end
   end
end

function response(status, headers, body)
   if sent_route and not overlapped then
      -- Buffered by C stdio, which wrk's exit flushes.
      latency_file:write(sent_route, " ", string.format("%.1f", now_us() - sent_at), "\n")
      sent_route = nil
   end
end

function extra_report(threads)
   local steps, timed = 0, true
   for _, thread in ipairs(threads) do
      steps = steps + thread:get("step")
      timed = timed and not thread:get("overlapped")
   end
   return string.format('{"steps":%d,"timed":%s}', steps, tostring(timed))
end

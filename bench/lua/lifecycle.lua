-- The request lifecycle mix: /add, /prefill_complete, /free, each id exactly once per route.
--   wrk -t1 -s lifecycle.lua URL -- <run id> <model> <hash lists file> <workers> <dp size> <lag>
--
-- wrk does not say which connection a request goes to, so a /prefill_complete must not be sent
-- right after its /add: another connection could deliver it first and get a 404. Step k sends
-- add(k), prefill_complete(k - lag), free(k - 2*lag); with lag far above the connection count
-- the /add has long been answered (any 404 would still show up as a status error).
-- Ids carry the run id, so every wrk run (warm-up included) uses fresh ones. One wrk thread
-- (-t1) is required: each thread has its own counter.
local run_id, model, lists, workers, dp_size, lag
local step, phase = 0, 0
-- wrk calls request() once more than it sends (the first answer is built and dropped), so
-- the first call answers a request whose loss breaks nothing.
local primed = false
local headers = { ["Content-Type"] = "application/json" }

function init(args)
   run_id, model = args[1], args[2]
   lists = {}
   for line in io.lines(args[3]) do
      lists[#lists + 1] = line  -- a JSON array of hashes, ready to splice
   end
   workers, dp_size, lag = tonumber(args[4]), tonumber(args[5]), tonumber(args[6])
end

local function id(k)
   return run_id .. "-" .. k
end

local function add(k)
   local slot = k % (workers * dp_size)
   local body = '{"model_name":"' .. model .. '","request_id":"' .. id(k) ..
      '","worker_id":' .. (slot % workers + 1) .. ',"dp_rank":' .. math.floor(slot / workers) ..
      ',"sequence_hashes":' .. lists[k % #lists + 1] .. ',"new_isl_tokens":4096}'
   return wrk.format("POST", "/add", headers, body)
end

local function by_id(path, k)
   return wrk.format("POST", path, headers, '{"model_name":"' .. model .. '","request_id":"' .. id(k) .. '"}')
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
         return add(k)
      elseif phase == 1 then
         phase = 2
         if k >= lag then return by_id("/prefill_complete", k - lag) end
      else
         phase, step = 0, step + 1
         if k >= 2 * lag then return by_id("/free", k - 2 * lag) end
      end
   end
end

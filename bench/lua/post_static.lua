-- POST one fixed JSON body read from a file.  wrk -s post_static.lua URL -- <path> <body file>
-- The request is formatted once: the load generator must cost the same for every server.
local req

function init(args)
   local file = assert(io.open(args[2], "rb"))
   local body = file:read("*a")
   file:close()
   req = wrk.format("POST", args[1], { ["Content-Type"] = "application/json" }, body)
end

function request()
   return req
end

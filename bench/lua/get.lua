-- GET one fixed path.  wrk -s get.lua URL -- <path>
local req

function init(args)
   req = wrk.format("GET", args[1])
end

function request()
   return req
end

-- The "shared-dict counter" of scripts/bench-compare: the least an exact
-- limit inside nginx can cost, the baseline of a request admitted from a
-- worker share (issue 34: a share's admission should cost what this costs).
-- One shared-dict incr per request on a fixed window of one second (the
-- counter is made with the window's life on its first incr), as
-- lua-resty-limit-traffic's resty.limit.count does, then the three
-- RateLimit headers lim:limit() sets in its default style, and 429 with
-- Retry-After past the limit. Exact on one host only: nothing is shared
-- with other gateways, which is what the daemon is for.

local ngx = ngx
local ngx_header = ngx.header
local ngx_exit = ngx.exit
local ngx_shared = ngx.shared
local setmetatable = setmetatable

local _M = {}
local Counter = {}
local counter_mt = { __index = Counter }

--- A counter of `limit` per second in the lua_shared_dict named `dict`.
function _M.new(dict, limit)
    return setmetatable({ dict = ngx_shared[dict], max = limit }, counter_mt)
end

function Counter.limit(self, key)
    local limit = self.max
    -- init 0, init_ttl 1 s: the first incr of a window makes it.
    local n = self.dict:incr(key, 1, 0, 1)
    ngx_header["RateLimit-Limit"] = limit
    ngx_header["RateLimit-Reset"] = 1
    if n and n <= limit then
        ngx_header["RateLimit-Remaining"] = limit - n
        return
    end
    ngx_header["RateLimit-Remaining"] = 0
    ngx_header["Retry-After"] = 1
    return ngx_exit(429)
end

return _M

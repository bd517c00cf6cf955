-- The "direct path" of scripts/bench-compare: what an nginx worker would do
-- without ratelimitd. Each worker calls EVALSHA of the daemon's own script
-- (src/redis/sliding_window.lua, loaded with SCRIPT LOAD by the bench) on
-- Redis itself, over a pooled cosocket, with the daemon's key layout and
-- arguments (src/redis/window.rs: KEYS[1] = "<prefix>{<key>}:<window>ms",
-- ARGV = window_ms, 0 = Redis TIME, a unique member, limit, cost), and acts
-- on the reply as lim:limit does: the three RateLimit headers, then 429 with
-- Retry-After when denied. A minimal RESP client written for the benchmark:
-- one sock:send of a table of pieces, one line read per reply element,
-- setkeepalive after a clean exchange. Not a product: no retry on a pooled
-- connection Redis closed, no NOSCRIPT reload (the bench loads the script).

local ngx = ngx
local tcp = ngx.socket.tcp
local ngx_header = ngx.header
local ngx_exit = ngx.exit
local ngx_log = ngx.log
local ERR = ngx.ERR
local byte, sub, tostring, tonumber = string.byte, string.sub, tostring, tonumber
local ceil, max = math.ceil, math.max
local setmetatable = setmetatable

local _M = {}
local Direct = {}
local direct_mt = { __index = Direct }

local function bulk(s)
    s = tostring(s)
    return "$" .. #s .. "\r\n" .. s .. "\r\n"
end

-- A limiter: opts.host, opts.port (Redis), opts.sha (of the script),
-- opts.prefix (the daemon's redis.key_prefix, "ratelimitd:" by default),
-- opts.limit, opts.window_ms. As with ratelimitd.new{}, the constant parts
-- of the command are built once; per request only the key and the member.
function _M.new(opts)
    local limit, window_ms = opts.limit, opts.window_ms
    return setmetatable({
        host = opts.host,
        port = opts.port,
        prefix = opts.prefix or "ratelimitd:",
        limit_value = limit,
        -- *9 EVALSHA sha 1 | key | window_ms now (0: Redis TIME) | member | limit cost
        head = "*9\r\n" .. bulk("EVALSHA") .. bulk(assert(opts.sha)) .. bulk(1),
        key_tail = "}:" .. window_ms .. "ms",
        args = bulk(window_ms) .. bulk(0),
        tail = bulk(limit) .. bulk(1),
    }, direct_mt)
end

local seq = 0
local member_prefix

-- One EVALSHA; returns allowed, remaining, reset_ms, retry_after_ms, or nil and an error.
local function evalsha(self, key)
    local sock = tcp()
    -- The daemon's redis.timeout_ms (20): Redis gets the same deadline on
    -- both paths, and a miss is an error on both.
    sock:settimeouts(20, 20, 20)
    local ok, err = sock:connect(self.host, self.port)
    if not ok then
        return nil, "connect: " .. err
    end
    if not member_prefix then
        -- Unique across workers (the pid) and requests (a sequence).
        member_prefix = "d" .. ngx.worker.pid() .. ":"
    end
    seq = seq + 1
    local member = member_prefix .. seq
    local prefix = self.prefix
    ok, err = sock:send({ self.head, "$", #prefix + 1 + #key + #self.key_tail, "\r\n", prefix, "{", key, self.key_tail, "\r\n",
                          self.args, "$", #member, "\r\n", member, "\r\n", self.tail })
    if not ok then
        sock:close()
        return nil, "send: " .. err
    end
    local line
    line, err = sock:receive()
    if not line or byte(line, 1) ~= 42 then -- '*'
        sock:close()
        return nil, line and ("redis: " .. line) or ("receive: " .. err)
    end
    local allowed, remaining, retry, reset
    for i = 1, 5 do
        line, err = sock:receive()
        if not line then
            sock:close()
            return nil, "receive: " .. err
        end
        if i == 1 then
            allowed = line == ":1"
        elseif i == 3 then
            remaining = tonumber(sub(line, 2))
        elseif i == 4 then
            retry = tonumber(sub(line, 2))
        elseif i == 5 then
            reset = tonumber(sub(line, 2))
        end
    end
    sock:setkeepalive(60000, 64)
    return allowed, remaining, reset, retry
end

-- For access_by_lua: as lim:limit(key) of resty.ratelimitd (fail closed).
function Direct.limit(self, key)
    local allowed, remaining, reset_ms, retry_ms = evalsha(self, key)
    if allowed == nil then
        ngx_log(ERR, "direct: ", remaining)
        return ngx_exit(503)
    end
    ngx_header["RateLimit-Limit"] = self.limit_value
    ngx_header["RateLimit-Remaining"] = remaining
    ngx_header["RateLimit-Reset"] = ceil(reset_ms / 1000)
    if allowed then
        return
    end
    ngx_header["Retry-After"] = max(1, ceil(retry_ms / 1000))
    return ngx_exit(429)
end

return _M

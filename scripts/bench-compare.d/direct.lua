-- The "direct path" of scripts/bench-compare: what an nginx worker would do
-- without ratelimitd. Each worker calls EVALSHA of the daemon's own script
-- (src/redis/scripts/sliding_window.lua, loaded with SCRIPT LOAD by the bench) on
-- Redis itself, over a pooled cosocket, with the daemon's key layout and
-- arguments (src/redis/window.rs: KEYS[1] = "<prefix>{<key>}:<window>ms",
-- ARGV = window_ms, 0 = Redis TIME, a unique member, limit, cost), and acts
-- on the reply as lim:limit does: the three RateLimit headers, then 429 with
-- Retry-After when denied. A minimal RESP client written for the benchmark:
-- one sock:send of a table of pieces, one line read per reply element,
-- setkeepalive after a clean exchange. Not a product: no retry on a pooled
-- connection Redis closed, no NOSCRIPT reload (the bench loads the script).
-- On a Redis Cluster (opts.slots, used by scripts/fleet) it sends each key
-- to the primary of the key's hash slot from a slot map taken when nginx
-- starts, as a cluster client with a fresh map does; a MOVED or ASK reply
-- (a resharding or failover) fails the request: the fleet does neither.

local ngx = ngx
local tcp = ngx.socket.tcp
local ngx_header = ngx.header
local ngx_exit = ngx.exit
local ngx_log = ngx.log
local ERR = ngx.ERR
local byte, sub, tostring, tonumber = string.byte, string.sub, tostring, tonumber
local ceil, max = math.ceil, math.max
local setmetatable = setmetatable
local find = string.find
local bit = require "bit"
local band, bxor, lshift, rshift = bit.band, bit.bxor, bit.lshift, bit.rshift

-- CRC16-CCITT (XMODEM), Redis Cluster's key hash, by table.
local crc_table = {}
do
    for i = 0, 255 do
        local crc = lshift(i, 8)
        for _ = 1, 8 do
            if band(crc, 0x8000) ~= 0 then
                crc = band(bxor(lshift(crc, 1), 0x1021), 0xffff)
            else
                crc = band(lshift(crc, 1), 0xffff)
            end
        end
        crc_table[i] = crc
    end
end

-- The hash slot of the full key "<prefix>{<key>}...": Redis hashes the
-- part between the first "{" and the first "}" after it, if not empty.
local function slot_of(key)
    local tag = key
    local close = find(key, "}", 1, true)
    if close and close > 1 then
        tag = sub(key, 1, close - 1)
    elseif close == 1 then
        return nil -- the whole stored key is hashed: not needed by the fleet
    end
    local crc = 0
    for i = 1, #tag do
        crc = bxor(band(lshift(crc, 8), 0xffff), crc_table[bxor(rshift(crc, 8), byte(tag, i))])
    end
    return band(crc, 16383)
end

local _M = {}
local Direct = {}
local direct_mt = { __index = Direct }

local function bulk(s)
    s = tostring(s)
    return "$" .. #s .. "\r\n" .. s .. "\r\n"
end

-- A limiter: opts.host, opts.port (Redis), opts.sha (of the script),
-- opts.prefix (the daemon's redis.key_prefix, "ratelimitd:" by default),
-- opts.limit, opts.window_ms; on a Redis Cluster opts.slots instead of
-- host and port: { {first_slot, last_slot, host, port}, ... }. As with ratelimitd.new{}, the constant parts
-- of the command are built once; per request only the key and the member.
function _M.new(opts)
    local limit, window_ms = opts.limit, opts.window_ms
    local slot_host, slot_port
    if opts.slots then
        slot_host, slot_port = {}, {}
        for _, range in ipairs(opts.slots) do
            for slot = range[1], range[2] do
                slot_host[slot], slot_port[slot] = range[3], range[4]
            end
        end
    end
    return setmetatable({
        host = opts.host,
        port = opts.port,
        slot_host = slot_host,
        slot_port = slot_port,
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
    local host, port = self.host, self.port
    local slot_host = self.slot_host
    if slot_host then
        local slot = slot_of(key)
        host, port = slot_host[slot], self.slot_port[slot]
        if not host then
            return nil, "no node for the key's slot"
        end
    end
    local ok, err = sock:connect(host, port)
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

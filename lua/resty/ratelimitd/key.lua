-- resty.ratelimitd.key: what a key from request data is sent as. Keys come
-- from headers and addresses, which a client chooses: none of them may
-- raise a Lua error, escape its limit, push the location into its fail
-- policy or put control bytes into a log line.

local settings = require("resty.ratelimitd.config").settings

local ngx = ngx
local md5 = ngx.md5
local byte, concat = string.byte, table.concat
local type, tostring = type, tostring
local floor = math.floor

local _M = {}

-- Whether `s` holds a control byte (0x00-0x1f, 0x7f): a loop of byte
-- compares, which LuaJIT compiles (string.find with a pattern it does not).
local function has_control(s)
    for i = 1, #s do
        local b = byte(s, i)
        if b < 32 or b == 127 then
            return true
        end
    end
    return false
end

-- An absent header (nil), a repeated one (a table, from
-- ngx.req.get_headers()) and a number are keys too: nil is the empty key,
-- a table its values joined as nginx joins repeated headers.
local function as_string(key)
    local t = type(key)
    if t == "string" then
        return key
    elseif t == "nil" then
        return ""
    elseif t == "number" then
        return tostring(key)
    elseif t == "table" then
        for i = 1, #key do
            if type(key[i]) ~= "string" then
                return nil
            end
        end
        return concat(key, ", ")
    end
end

-- What every hashed key begins with, and no key sent as it is: a key that
-- begins with it is hashed too. So a client cannot send the text another
-- key is hashed to (a 600-byte tenant id's "md5:<hex>", or the empty key's)
-- and spend that key's window: a key sent as it is never begins with
-- HASHED, and two keys hashed share a window only if their md5s collide
-- (docs/NGINX.md section 5; docs/PROTOCOL.md section 4).
local HASHED = "md5:"
-- Its bytes: compared in place, so a key sent as it is makes no substring.
local M, D, FIVE, COLON = byte(HASHED, 1, 4)

--- The wire key of `key`: itself, or "md5:<hex>" of it when it is empty,
-- longer than max_key_len, holds a control byte (the daemon refuses
-- those) or begins with "md5:" (above). Computed once per request: the
-- frame, the local fallback and every log line use the same value. nil
-- and a message only for a key no request can produce (a boolean, a
-- function): a bug in the code, which the caller raises.
function _M.wire(key)
    local s = as_string(key)
    if not s then
        return nil, "key must be a string (or nil, a number, a list of strings), not a " .. type(key)
    end
    local b1, b2, b3, b4 = byte(s, 1, 4)
    if s == "" or #s > settings.max_key_len or has_control(s) or (b1 == M and b2 == D and b3 == FIVE and b4 == COLON) then
        return HASHED .. md5(s)
    end
    return s
end

--- The per-request arguments of a limiter's methods: the wire key and the
-- cost (1 by default, at most `limit` when the limiter knows its limit;
-- a policy's is the daemon's, which refuses a cost above it as
-- INVALID_COST); or nil and what is wrong (a bug in the code: the caller
-- raises it).
function _M.args(key, cost, limit)
    local wkey, err = _M.wire(key)
    if not wkey then
        return nil, err
    end
    if cost == nil then
        return wkey, 1
    end
    if type(cost) ~= "number" or cost < 1 or cost > (limit or 4294967295) or floor(cost) ~= cost then
        -- Above the limit a request can never be admitted; the daemon would
        -- refuse it (INVALID_COST) and the fail policy would decide, which
        -- for "open" lets it through.
        return nil, limit and "cost must be an integer from 1 to the limit (" .. limit .. ")" or "cost must be a positive integer"
    end
    return wkey, cost
end

return _M

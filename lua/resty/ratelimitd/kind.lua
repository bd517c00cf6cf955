-- resty.ratelimitd.kind: what every limiter kind shares: its class and
-- metatable, the check of its per-request arguments, the check() and
-- limit() methods over the kind's own _decide, the decision from a worker
-- share before the kind's own way to the daemon (share_first), and the
-- frame header a policy limiter builds once (header).
-- A kind gives _decide (and may replace _fallback and _label, see
-- http.lua).
--
-- The per-request arguments are checked here, and with them what a key
-- from request data is sent as (wire_key). Keys come from headers and
-- addresses, which a client chooses: none of them may raise a Lua error,
-- escape its limit, push the location into its fail policy or put control
-- bytes into a log line.

local http = require "resty.ratelimitd.http"
local options = require "resty.ratelimitd.options"
local verify = require "resty.ratelimitd.verify"
local share = require "resty.ratelimitd.share"
local config = require "resty.ratelimitd.config"

local error, getmetatable, setmetatable = error, getmetatable, setmetatable
local type, tostring = type, tostring
local byte, concat = string.byte, table.concat
local floor = math.floor
local ngx = ngx
local md5 = ngx.md5
local settings = config.settings

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
function _M.wire_key(key)
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
function _M.key_args(key, cost, limit)
    local wkey, err = _M.wire_key(key)
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
local key_args = _M.key_args

local function same_key(_, key)
    return key
end

--- A new kind: its class, its metatable and its argument check
-- args(self, key, cost) -> wire key(s), cost(s). Bad arguments are a bug in
-- the code: raised with `usage` (a call without the colon) or what is
-- wrong, at the line that called the method (level 3: the method calls
-- args itself). `args`, when given, checks a kind's own arguments after
-- the metatable (keys and costs of a multi-item limiter).
function _M.class(usage, args)
    local class = { _fallback = http.fallback, _label = same_key }
    local mt = { __index = class }
    local function checked(self, key, cost)
        if getmetatable(self) ~= mt then
            error(usage, 3)
        end
        local wkey, c = (args or key_args)(key, cost, self._limit, self)
        if not wkey then
            error(c, 3)
        end
        return wkey, c
    end
    return class, mt, checked
end

--- check() and limit() of a rate limiter kind.
function _M.rate_methods(class, checked)
    --- Asks the daemon for `key` (cost 1 by default). Returns a table {
    -- allowed, decision, source, count, remaining, retry_after_ms,
    -- reset_ms, limit, error_code, error, message } (policy limiters: also
    -- policy; multi-item ones: items, refused, handle), or nil and a string
    -- when the daemon could not be reached or answered badly.
    function class.check(self, key, cost)
        local wkey, c = checked(self, key, cost)
        return self:_decide(wkey, c)
    end

    --- For access_by_lua*: lets the request through, or ends it with the
    -- limiter's `status` (429 by default; 503 when the policy is closed and
    -- nothing could decide). Returns the decision table (after a pass, or
    -- in dry run).
    function class.limit(self, key, cost)
        local wkey, c = checked(self, key, cost)
        return http.enforce(self, self, wkey, c)
    end
end

--- One decision of a rate limiter kind that takes worker shares (share.lua):
-- from the host's worker share of the daemon's quota lease on `key`, with no round trip,
-- else `ask(lim, key, cost)` (the kind's own way to the daemon), whose
-- admission from Redis tops the share up. `ask` is a function of the
-- kind's module: no closure per request.
function _M.share_first(lim, key, cost, ask)
    local dict = share.dict(lim, settings)
    if dict then
        local res = share.admit(lim, dict, key, cost)
        if res then
            return res
        end
    end
    local res, err = ask(lim, key, cost)
    if dict and res and res.decision == "allowed" and res.source == "redis" then
        share.refill(lim, dict, key, res)
    end
    return res, err
end

--- The frame header of a policy limiter (one policy or several), built
-- once, on the request path: lim._header once built, else build(lim),
-- which is nil while on_error is "local" and the local quota, to come from
-- the daemon, is not known. Such a limiter cannot send its first request
-- before it knows its quota: it describes its policy itself (verify.now:
-- one round trip, once) if the worker-start verifier has not yet; an
-- unknown name is asked again (a reload may add it, as a CHECK_POLICY
-- would be). The header, or nil and why not.
function _M.header(lim, build)
    local h = lim._header or build(lim)
    if h then
        return h
    end
    local ok, err = lim._described and not lim._unknown, nil
    if not ok then
        ok, err = verify.now(lim)
    end
    h = ok and build(lim)
    if h then
        return h
    end
    local which = lim._names and ("a policy of \"" .. concat(lim._names, ",") .. "\"") or ("policy \"" .. lim._policy .. "\"")
    if lim._unknown then
        return nil, err or ("UNKNOWN_POLICY: " .. which .. " is not in the daemon's configuration")
    end
    return nil, err or (which .. " has no local_limit in the daemon: on_error = \"local\" needs local_limit here or in ratelimitd.toml")
end

--- The constructor of a kind: validates `opts` against the option specs of
-- `spec` (options.lua) once, then builds the limiter from them with
-- build(opts, on_error) (the kind's own fields: the constant parts of its
-- frames), with its metatable and behaviour options. Returns the limiter,
-- or nil and the first problem, after `prefix` ("new: ").
function _M.constructor(mt, spec, prefix, build)
    return function(opts)
        local on_error, err = options.check(spec, opts)
        if not on_error then
            return nil, prefix .. err
        end
        local lim = build(opts, on_error)
        lim._on_error = on_error
        -- Not chosen by the location: a policy's own on_error may replace
        -- it once the daemon has described the policy (verify.lua).
        lim._on_error_defaulted = opts.on_error == nil
        lim._local_limit = opts.local_limit
        -- Policies in shadow mode: never in the headers (http.lua).
        lim._shadow = options.name_set(opts.shadow)
        lim = options.copy_behaviour(setmetatable(lim, mt), opts)
        if lim._policy then
            verify.register(lim)
        end
        -- A policy limiter says it once its policy is described: the
        -- policy's own on_error may be the choice.
        if opts.on_error == nil and not lim._policy then
            config.default_on_error(spec)
        end
        return lim
    end
end

return _M

-- resty.ratelimitd.kind: what every limiter kind shares: its class and
-- metatable, the check of its per-request arguments, the check() and
-- limit() methods over the kind's own _decide, and (share_first) the
-- decision from a worker share before the kind's own way to the daemon.
-- A kind gives _decide (and may replace _fallback and _label, see
-- http.lua).

local http = require "resty.ratelimitd.http"
local fallback = require "resty.ratelimitd.fallback"
local options = require "resty.ratelimitd.options"
local verify = require "resty.ratelimitd.verify"
local key_args = require("resty.ratelimitd.key").args
local share = require "resty.ratelimitd.share"
local config = require "resty.ratelimitd.config"

local error, getmetatable, setmetatable = error, getmetatable, setmetatable
local settings = config.settings

local _M = {}

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
    local class = { _fallback = fallback.one, _label = same_key }
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
        -- it once the daemon has described the policy (describe.lua).
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

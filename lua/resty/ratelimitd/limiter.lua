-- resty.ratelimitd.limiter: the inline limiter, whose limit, window and
-- algorithm are the location's (new{ limit = ..., window_ms = ... }; the
-- table form's limiters are these too, form.lua), with the denial cache in
-- front of the daemon. Validated
-- once; the constant part of its request frame is built once, and each
-- request only encodes its id, cost and key.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local cache = require "resty.ratelimitd.cache"
local kind = require "resty.ratelimitd.kind"
local settings = require("resty.ratelimitd.config").settings

local ngx = ngx
local ngx_shared = ngx.shared
local setmetatable = setmetatable
local next_id, ask_daemon, encode_check = conn.next_id, conn.ask, wire.check
local share_first = kind.share_first

local _M = {}

local decide_cached

local Limiter, mt, checked = kind.class("call it as lim:limit(key, cost) / lim:check(key, cost), with a colon, on an object from new()")

-- false (no shares) for every algorithm but the log's; nil: configure()'s
-- shared dict decides (share.dict).
local function share_dict_of(algorithm)
    if algorithm ~= "log" then
        return false
    end
    return nil
end

-- A limiter from values already validated (by new() or by the table form),
-- without the behaviour options (all nil: configure()'s values).
local function build(limit, window_ms, on_error, local_limit, algorithm)
    local before, after, one = wire.check_parts(algorithm, on_error, limit, window_ms, local_limit)
    return setmetatable({
        _limit = limit,
        _window_ms = window_ms,
        _algorithm = algorithm,
        _on_error = on_error,
        _local_limit = local_limit,
        _before_cost = before,
        _after_cost = after,
        -- The whole constant part for the usual cost of 1: one piece fewer.
        _cost_one = one,
        -- The denial cache's keys: "\1<limit>|<window_ms>|<wire key>"
        -- (the log), "\1<algorithm>|<limit>|..." (the others: each has
        -- windows of its own). A wire key holds no control byte, so no
        -- local fallback key (which starts with the wire key) can be one.
        _deny_prefix = "\1" .. (algorithm == "log" and "" or algorithm .. "|") .. limit .. "|" .. window_ms .. "|",
        -- Worker shares (share.lua) of the log's quota leases only, the daemon's
        -- rule: false for the other algorithms. Entries "\2|<limit>|<window_ms>|<key>":
        -- '|' is above every policy name's length byte, so no inline entry
        -- is a policy limiter's.
        -- (Not `algorithm ~= "log" and false or nil`: that is nil for
        -- every algorithm, since `x and false` is never true.)
        _share_dict = share_dict_of(algorithm),
        _share_prefix = "\2|" .. limit .. "|" .. window_ms .. "|",
        _share_before = algorithm == "log" and wire.share_parts(on_error, limit, window_ms) or nil,
        _share_after = after,
    }, mt)
end

-- One exchange with the daemon: the decision table, or nil and an error.
local function ask(self, key, cost)
    local id = next_id()
    return ask_daemon(self, encode_check(id, self._before_cost, self._after_cost, self._cost_one, cost, key), id)
end

-- The CHECK with the share flag of `units` for `key` (share.lua); with
-- `back`, the give-back of `units` unused.
function Limiter._share_frame(self, id, units, key, back)
    return wire.share(id, self._share_before, self._share_after, units, key, back)
end

-- One decision: from the host's worker share of the daemon's quota lease, else the
-- denial cache, else the daemon. `key` is the wire key, `cost` already checked.
function Limiter._decide(self, key, cost)
    return share_first(self, key, cost, decide_cached)
end

-- From the denial cache, else from the daemon.
function decide_cached(self, key, cost)
    local on = self._denial_cache
    if on == nil then
        on = settings.denial_cache
    end
    local mono_us = conn.mono_us
    local dict = on and mono_us and ngx_shared[settings.shared_dict]
    if not dict then
        return ask(self, key, cost)
    end
    local ckey = self._deny_prefix .. key
    local sent = mono_us()
    local hit = cache.refusal(dict, ckey, cost, sent, self._limit)
    if hit then
        return hit
    end
    local res, err = ask(self, key, cost)
    if res and res.decision == "denied" and (res.source == "redis" or res.source == "denial_cache") then
        cache.remember(dict, ckey, cost, res, sent, settings.denial_cache_max_ms)
    end
    return res, err
end

kind.rate_methods(Limiter, checked)

--- new{ limit, window_ms, ... }: the limiter, or nil and a message.
_M.new = kind.constructor(mt, "inline", "new: ", function(opts, on_error)
    local lim = build(opts.limit, opts.window_ms, on_error, opts.local_limit, opts.algorithm or "log")
    -- nil: configure()'s denial_cache decides at each request.
    lim._denial_cache = opts.denial_cache
    -- A dict's name, false (off), or nil: configure()'s shared_dict (share.dict).
    if opts.share_dict ~= nil and lim._share_dict == nil then
        lim._share_dict = opts.share_dict and ngx_shared[opts.share_dict]
    end
    return lim
end)

--- A limiter of these values, already validated (the table form's).
_M.build = build

--- One decision of `lim` for `key` (a wire key) of `cost` (checked):
-- from the denial cache, else from the daemon.
_M.decide = Limiter._decide

return _M

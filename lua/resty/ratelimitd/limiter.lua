-- resty.ratelimitd.limiter: the inline limiter, whose limit, window and
-- algorithm are the location's (new{ limit = ..., window_ms = ... } and the
-- table form), with the denial cache in front of the daemon. Validated
-- once; the constant part of its request frame is built once, and each
-- request only encodes its id, cost and key.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local cache = require "resty.ratelimitd.cache"
local kind = require "resty.ratelimitd.kind"
local options = require "resty.ratelimitd.options"
local http = require "resty.ratelimitd.http"
local wire_key = require("resty.ratelimitd.key").wire
local settings = require("resty.ratelimitd.config").settings

local ngx = ngx
local ngx_shared = ngx.shared
local type, error, setmetatable = type, error, setmetatable
local next_id, ask_daemon, encode_check = conn.next_id, conn.ask, wire.check

local _M = {}

local Limiter, mt, checked = kind.class("call it as lim:limit(key, cost) / lim:check(key, cost), with a colon, on an object from new()")

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
    }, mt)
end

-- One exchange with the daemon: the decision table, or nil and an error.
local function ask(self, key, cost)
    local id = next_id()
    return ask_daemon(self, encode_check(id, self._before_cost, self._after_cost, self._cost_one, cost, key), id)
end

-- One decision: from the denial cache, else from the daemon. `key` is the
-- wire key, `cost` already checked.
function Limiter._decide(self, key, cost)
    local on = self._denial_cache
    if on == nil then
        on = settings.denial_cache
    end
    local mono_us = cache.mono_us
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
    return lim
end)

-- The table form does not build a limiter per call (measured: that alone
-- costs more than the whole call did before the object form): the limiters
-- of the option sets it has seen are kept by what goes into the frame
-- (policy and algorithm, limit, window_ms, local_limit), and its other
-- options are read from its own table at each call. Bounded: past
-- CACHE_MAX limiters the cache starts over, so limits computed per request
-- cannot grow it without end.
local CACHE_MAX = 256
local by_mode, cached = {}, 0

local function cached_limiter(opts, on_error, algorithm)
    local limit, window_ms, local_limit = opts.limit, opts.window_ms, opts.local_limit
    local mode = algorithm == "log" and on_error or on_error .. "|" .. algorithm
    local by_limit = by_mode[mode]
    local by_window = by_limit and by_limit[limit]
    local by_local = by_window and by_window[window_ms]
    local lim = by_local and by_local[local_limit or 0]
    if lim then
        return lim
    end
    if cached >= CACHE_MAX then
        by_mode, cached = {}, 0
        by_limit, by_window, by_local = nil, nil, nil
    end
    if not by_limit then
        by_limit = {}
        by_mode[mode] = by_limit
    end
    if not by_window then
        by_window = {}
        by_limit[limit] = by_window
    end
    if not by_local then
        by_local = {}
        by_window[window_ms] = by_local
    end
    lim = build(limit, window_ms, on_error, local_limit, algorithm)
    by_local[local_limit or 0] = lim
    cached = cached + 1
    return lim
end

-- The table form's limiter and wire key for `opts`; bad options are the
-- caller's bug, raised at `level` above this function's caller.
local function table_form(opts)
    if type(opts) ~= "table" then
        error("expects a table of options", 3)
    end
    local on_error, err = options.check("table_form", opts)
    if not on_error then
        error(err, 3)
    end
    local wkey
    wkey, err = wire_key(opts.key)
    if not wkey then
        error(err, 3)
    end
    return cached_limiter(opts, on_error, opts.algorithm or "log"), wkey
end

--- Table form of limit, for access_by_lua*. Options: key, limit, window_ms,
-- cost, on_error, local_limit, status, fail_closed_status, headers,
-- header_style, dry_run, algorithm, nodelay, delay. Validates them on every
-- call (raising on a bad one) and builds a limiter for the call.
function _M.limit(opts)
    local lim, wkey = table_form(opts)
    return http.enforce(lim, opts, wkey, opts.cost or 1)
end

--- Asks the daemon; table form of check (see docs/NGINX.md).
function _M.check(opts)
    local lim, wkey = table_form(opts)
    return Limiter._decide(lim, wkey, opts.cost or 1)
end

return _M

-- resty.ratelimitd.form: the table form, limit{ key = ..., limit = ...,
-- window_ms = ..., ... } and check{ ... }: the options validated at every
-- call (raising on a bad one: the caller's bug), and the inline limiter of
-- those options looked up in a bounded cache, not built per call.

local limiter = require "resty.ratelimitd.limiter"
local options = require "resty.ratelimitd.options"
local http = require "resty.ratelimitd.http"
local wire_key = require("resty.ratelimitd.kind").wire_key
local config = require "resty.ratelimitd.config"

local type, error = type, error

local _M = {}

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
    lim = limiter.build(limit, window_ms, on_error, local_limit, algorithm)
    if opts.on_error == nil then
        config.default_on_error("limit{} (table form)")
    end
    by_local[local_limit or 0] = lim
    cached = cached + 1
    return lim
end

-- The table form's limiter and wire key for `opts`; bad options are the
-- caller's bug, raised at the line that called limit{} or check{}.
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
    return limiter.decide(lim, wkey, opts.cost or 1)
end

return _M

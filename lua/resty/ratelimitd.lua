-- resty.ratelimitd: the OpenResty / ngx_lua client of the ratelimitd daemon.
--
-- Speaks the daemon's binary protocol (docs/PROTOCOL.md) over a pooled
-- cosocket to a Unix socket, applies the location's fail policy when the
-- daemon is unreachable or slow, and sets the RateLimit headers.
--
-- Object form: options are validated once, the constant part of the request
-- frame is built once, and each request only encodes its id, cost and key.
--
--   init_by_lua_block    { local ratelimitd = require "resty.ratelimitd"
--                          ratelimitd.configure{ socket = "unix:/run/ratelimitd/ratelimitd.sock" }
--                          order = assert(ratelimitd.new{ limit = 1000, window_ms = 1000, on_error = "closed" }) }
--   access_by_lua_block  { order:limit("order:" .. ngx.var.http_x_tenant_id) }
--
-- Named policy (limit, window, overrides and allowlist live in the daemon's
-- ratelimitd.toml, docs/POLICIES.md; the location keeps its fail policy):
--
--   init_by_lua_block    { order = assert(require("resty.ratelimitd").new("order")) }
--   access_by_lua_block  { order:limit(ngx.var.http_x_tenant_id) }
--
-- Table form (validates and builds everything on every call; still supported):
--
--   access_by_lua_block  { require("resty.ratelimitd").limit{ key = "order:" .. ngx.var.http_x_tenant_id,
--                                                               limit = 1000, window_ms = 1000, on_error = "closed" } }

local bit = require "bit"

local ngx = ngx
local ngx_log = ngx.log
local ngx_now = ngx.now
local ngx_exit = ngx.exit
local ngx_sleep = ngx.sleep
local ngx_header = ngx.header
local ngx_shared = ngx.shared
local tcp = ngx.socket.tcp
local ERR, INFO = ngx.ERR, ngx.INFO
local band, rshift = bit.band, bit.rshift
local byte, char, sub, format = string.byte, string.char, string.sub, string.format
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local type, error, tostring, pairs, ipairs = type, error, tostring, pairs, ipairs
local setmetatable = setmetatable
local find = string.find
local concat = table.concat
local md5 = ngx.md5

local _M = { _VERSION = "0.2.0" }

local VERSION, OP_CHECK, OP_CHECK_POLICY, OP_REFUND = 1, 1, 2, 3
local OP_ACQUIRE, OP_RELEASE = 5, 6
-- ACQUIRE_POLICY (section 4e): a lease of a named concurrency policy; with
-- the flag 0x0001, its release.
local OP_ACQUIRE_POLICY, FLAG_RELEASE = 7, 1
local FLAG_REFUNDABLE = 1
local MAX_POLICY_ITEMS = 8
local MAX_POLICY_NAME_LEN = 31
local UNKNOWN_POLICY = 12
local RESPONSE_FIXED_LEN = 28
-- The message, then (multi-item or refundable checks, PROTOCOL.md 5b) the
-- extension: 3 bytes, a 16-byte handle and 26 bytes per item.
local MAX_RESPONSE_LEN = RESPONSE_FIXED_LEN + 512 + 3 + 16 + MAX_POLICY_ITEMS * 26
-- The length prefix and the fixed fields: read in one receive (a message
-- follows only with an error code, and is read by a second one).
local RESPONSE_HEAD_LEN = 4 + RESPONSE_FIXED_LEN

-- The denial cache's clock: CLOCK_MONOTONIC in µs, fresh at each call (a
-- vDSO read, no syscall) and the same for every worker of the host, unlike
-- ngx.now() (the wall clock, as cached at the start of the event loop
-- iteration: stale by up to that iteration's length, and stepped by NTP).
-- Read through the FFI into a buffer made once; the two 32-bit halves of
-- each field are read separately, so no 64-bit cdata is boxed per call.
-- Without the FFI, or on a big-endian or 32-bit ABI, the cache is off.
local mono_us
do
    local ok, ffi = pcall(require, "ffi")
    if ok and ffi.abi("64bit") and ffi.abi("le") and ffi.os == "Linux" then
        -- Once per process: a second copy of the module (package.loaded
        -- cleared, a benchmark) finds the declarations already made.
        ok = pcall(ffi.typeof, "ratelimitd_timespec_t") or pcall(ffi.cdef, [[
            typedef struct { uint32_t sec_lo, sec_hi, nsec_lo, nsec_hi; } ratelimitd_timespec_t;
            int ratelimitd_clock_gettime(int clock_id, ratelimitd_timespec_t *tp) __asm__("clock_gettime");
        ]])
        if ok then
            local C = ffi.C
            local ts = ffi.new("ratelimitd_timespec_t[1]")
            local CLOCK_MONOTONIC = 1
            mono_us = function()
                C.ratelimitd_clock_gettime(CLOCK_MONOTONIC, ts)
                local t = ts[0]
                return (t.sec_hi * 4294967296 + t.sec_lo) * 1000000 + floor(t.nsec_lo / 1000)
            end
            if not pcall(mono_us) then
                mono_us = nil
            end
        end
    end
end

local POLICY = { open = 0, closed = 1, ["local"] = 2 }
-- How a limit counts (docs/ALGORITHMS.md); sent in the CHECK flags' bits
-- 0x0F00 (the first flags byte), 0 (the log) when not chosen.
local ALGORITHM = { log = 0, ring = 1, gcra = 2, sliding_counter = 3, fixed = 4 }
local DECISION = { [0] = "allowed", [1] = "denied", [2] = "error", [3] = "shadow_denied" }
local SOURCE = { [0] = "redis", [1] = "local", [2] = "fail_open", [3] = "fail_closed", [4] = "memory", [5] = "denial_cache", [6] = "exempt", [255] = "none" }
local ERROR_NAME = {
    [0] = "OK", [1] = "MALFORMED", [2] = "UNSUPPORTED_VERSION", [3] = "UNKNOWN_OP",
    [4] = "UNSUPPORTED_FLAGS", [5] = "UNSUPPORTED_LIMIT_COUNT", [6] = "INVALID_KEY",
    [7] = "INVALID_LIMIT", [8] = "INVALID_WINDOW", [9] = "INVALID_COST", [10] = "INVALID_POLICY",
    [11] = "INVALID_LOCAL_LIMIT", [12] = "UNKNOWN_POLICY", [13] = "DUPLICATE_ITEM",
    [14] = "REFUND_UNSUPPORTED", [16] = "UNKNOWN_ALGORITHM", [17] = "INVALID_LEASE",
    [18] = "WRONG_POLICY_KIND", [19] = "UNSUPPORTED_COMBINATION",
    [20] = "FRAME_TOO_LARGE", [30] = "REDIS_TIMEOUT",
    [31] = "REDIS_UNAVAILABLE", [32] = "REDIS_ERROR", [33] = "CIRCUIT_OPEN", [34] = "LOCAL_CAPACITY",
    [35] = "OVERLOADED",
}

-- Settings shared by every call; changed with configure().
local config = {
    socket = "unix:/run/ratelimitd/ratelimitd.sock",
    connect_timeout = 20,     -- ms
    send_timeout = 20,        -- ms
    read_timeout = 50,        -- ms; above the daemon's redis.timeout_ms (20), so
                              -- a slow Redis is answered by the daemon's policy
    pool_size = 64,           -- idle connections kept per worker
    keepalive_timeout = 60000, -- ms an idle pooled connection is kept
    status = 429,             -- status of a denied request
    fail_closed_status = 503, -- status when the policy is "closed" and no decision could be made
    invalid_status = 500,     -- status when the daemon refuses the request as invalid
                              -- (a configuration bug, never decided by on_error)
    headers = true,           -- set RateLimit headers
    header_style = "ratelimit", -- "ratelimit" | "draft" (RateLimit + RateLimit-Policy) | "x" (X-RateLimit-*)
    shared_dict = "ratelimitd", -- lua_shared_dict of the local fallback
    log_interval = 1,         -- s between two fail-policy log lines per worker
    max_key_len = 512,        -- longer keys are sent as "md5:<hex>"; keep it at or
                              -- below the daemon's limits.max_key_len
    denial_cache = true,      -- refuse a key the daemon refused, in shared_dict,
                              -- until it could pass (docs/NGINX.md section 4)
    denial_cache_max_ms = 1000, -- longest an entry refuses without asking the
                              -- daemon: how late a reset is seen
    problem_body = false,     -- a refusal's body: application/problem+json, the
                              -- draft's quota-exceeded type with violated-policies
    log_var = "",             -- name of an nginx variable (declared with set) that
                              -- limit() sets to its outcome, for access logs
    set_ctx = false,          -- every limiter's limit() stores its decision in
                              -- ngx.ctx.ratelimitd (multi-policy and refundable
                              -- limiters always do)
}

local KNOWN_CONFIG = {}
for k in pairs(config) do
    KNOWN_CONFIG[k] = true
end

local HEADER_STYLES = { ratelimit = true, draft = true, x = true }

--- Sets defaults for every later call; call once from init_by_lua*.
-- Limiters made with new() read these at each request, so configure() may
-- run before or after they are created.
function _M.configure(opts)
    if type(opts) ~= "table" then
        error("configure: expects a table", 2)
    end
    for k, v in pairs(opts) do
        if not KNOWN_CONFIG[k] then
            error("configure: unknown option '" .. tostring(k) .. "'", 2)
        end
        if type(v) ~= type(config[k]) then
            error("configure: option '" .. k .. "' must be a " .. type(config[k]), 2)
        end
    end
    if opts.header_style and not HEADER_STYLES[opts.header_style] then
        error("configure: header_style must be 'ratelimit', 'draft' or 'x'", 2)
    end
    for _, k in ipairs({ "connect_timeout", "send_timeout", "read_timeout", "pool_size", "keepalive_timeout", "max_key_len", "denial_cache_max_ms" }) do
        if opts[k] ~= nil and (opts[k] < 1 or floor(opts[k]) ~= opts[k]) then
            error("configure: " .. k .. " must be a positive integer", 2)
        end
    end
    for _, k in ipairs({ "status", "fail_closed_status", "invalid_status" }) do
        if opts[k] ~= nil and not (opts[k] >= 200 and opts[k] <= 599 and floor(opts[k]) == opts[k]) then
            error("configure: " .. k .. " must be an HTTP status (200-599)", 2)
        end
    end
    if opts.denial_cache_max_ms ~= nil and opts.denial_cache_max_ms > 60000 then
        error("configure: denial_cache_max_ms must be at most 60000", 2)
    end
    if opts.log_interval ~= nil and opts.log_interval < 0 then
        error("configure: log_interval must not be negative", 2)
    end
    for k, v in pairs(opts) do
        config[k] = v
    end
    if sub(config.socket, 1, 5) ~= "unix:" then
        config.socket = "unix:" .. config.socket
    end
    return true
end

local function u32(n)
    return char(band(rshift(n, 24), 255), band(rshift(n, 16), 255), band(rshift(n, 8), 255), band(n, 255))
end

local function be32(s, at)
    local a, b, c, d = byte(s, at, at + 3)
    return ((a * 256 + b) * 256 + c) * 256 + d
end

local function be16(s, at)
    local a, b = byte(s, at, at + 1)
    return a * 256 + b
end

-- 56-bit big-endian integers (µs of the monotonic clock; exact below 2^53).
local function u56(n)
    local hi = floor(n / 4294967296)
    return char(band(rshift(hi, 16), 255), band(rshift(hi, 8), 255), band(hi, 255)) .. u32(n - hi * 4294967296)
end

local function be56(s, at)
    local a, b, c = byte(s, at, at + 2)
    return ((a * 256 + b) * 256 + c) * 4294967296 + be32(s, at + 3)
end

local function positive_int(v, max_value)
    return type(v) == "number" and v >= 1 and v <= max_value and floor(v) == v
end

-- The checks of new() and of the table form, returning a message instead of
-- raising: new() hands it back as nil, err, the table form raises it. Split
-- in two so that the table form keeps its historical order (key, limit,
-- window_ms, cost, then the rest) and so its first error stays the same.
local function limit_window_error(opts)
    if not positive_int(opts.limit, 4294967295) then
        return "limit must be a positive integer"
    end
    if not positive_int(opts.window_ms, 4294967295) then
        return "window_ms must be a positive integer"
    end
end

local STATUS_OPTIONS = { "status", "fail_closed_status", "invalid_status" }
local BOOLEAN_OPTIONS = { "headers", "dry_run" }

-- Returns the policy name, or nil and a message.
local function policy_options(opts)
    local on_error = opts.on_error or "closed"
    if POLICY[on_error] == nil then
        return nil, "on_error must be 'open', 'closed' or 'local'"
    end
    if on_error == "local" and not positive_int(opts.local_limit, 4294967295) then
        return nil, "on_error = 'local' needs a positive integer local_limit"
    end
    if opts.local_limit ~= nil and not positive_int(opts.local_limit, 4294967295) then
        return nil, "local_limit must be a positive integer"
    end
    if opts.header_style ~= nil and not HEADER_STYLES[opts.header_style] then
        return nil, "header_style must be 'ratelimit', 'draft' or 'x'"
    end
    for _, k in ipairs(STATUS_OPTIONS) do
        local v = opts[k]
        if v ~= nil and not (type(v) == "number" and v >= 200 and v <= 599 and floor(v) == v) then
            return nil, k .. " must be an HTTP status (200-599)"
        end
    end
    for _, k in ipairs(BOOLEAN_OPTIONS) do
        if opts[k] ~= nil and type(opts[k]) ~= "boolean" then
            return nil, k .. " must be a boolean"
        end
    end
    return on_error
end

-- The algorithm option of new() and the table form: its name, or nil and a
-- message. The log when not given.
local function algorithm_option(opts)
    local algorithm = opts.algorithm or "log"
    if ALGORITHM[algorithm] == nil then
        local names = {}
        for name, v in pairs(ALGORITHM) do
            names[v + 1] = "'" .. name .. "'"
        end
        return nil, "algorithm must be one of " .. table.concat(names, ", ")
    end
    -- Pacing, as nginx limit_req: without nodelay an admitted request
    -- waits its delay; `delay` requests of a burst pass at once first.
    if opts.nodelay ~= nil and type(opts.nodelay) ~= "boolean" then
        return nil, "nodelay must be a boolean"
    end
    if opts.delay ~= nil and not (type(opts.delay) == "number" and opts.delay >= 0 and floor(opts.delay) == opts.delay) then
        return nil, "delay must be a non-negative integer (requests of a burst passed at once)"
    end
    if (opts.nodelay ~= nil or opts.delay ~= nil) and algorithm ~= "gcra" then
        return nil, "nodelay and delay apply to algorithm = 'gcra' only"
    end
    return algorithm
end

-- Validates the options of the table form; bad ones are the caller's bug.
local function check_opts(opts, level)
    if type(opts) ~= "table" then
        error("expects a table of options", level)
    end
    local key = opts.key
    if type(key) ~= "string" or key == "" then
        error("key must be a non-empty string", level)
    end
    local err = limit_window_error(opts)
    if err then
        error(err, level)
    end
    if opts.cost ~= nil and not positive_int(opts.cost, 4294967295) then
        error("cost must be a positive integer", level)
    end
    local on_error
    on_error, err = policy_options(opts)
    if not on_error then
        error(err, level)
    end
    local algorithm
    algorithm, err = algorithm_option(opts)
    if not algorithm then
        error(err, level)
    end
    return on_error, algorithm
end

-- Keys come from request data (headers, addresses). One too long for the
-- daemon, or with control bytes, is replaced by its MD5: a client cannot
-- escape its limit, or push the location into its fail policy, by sending
-- odd header values. Computed once per request: the frame, the local
-- fallback and every log line use the same value.
local function wire_key(key)
    if #key > config.max_key_len or find(key, "%c") then
        return "md5:" .. md5(key)
    end
    return key
end

local request_id = 0

local function next_id()
    request_id = request_id + 1
    if request_id > 4294967295 then
        request_id = 1
    end
    return request_id
end

-- Request body after the id (PROTOCOL.md section 4): flags (the algorithm), policy,
-- n_limits (1), limit, window_ms | cost | local_limit. The parts around cost
-- never change for a limiter, so new() builds them once.
local COST_ONE = u32(1)

-- Objects keep the options that only decide what limit() does with a
-- decision under the option names (status, fail_closed_status, headers,
-- header_style, dry_run), so that the table form can pass its own options
-- table in their place; what goes into the frame is kept under "_" names.
local Limiter = {}
local limiter_mt = { __index = Limiter }
local new_policy, new_multi, multi_args, multi_exchange

-- A limiter from values already validated (by new() or by the table form),
-- without the behaviour options (all nil: configure()'s values).
local function build(limit, window_ms, on_error, local_limit, algorithm)
    local before_cost = char(ALGORITHM[algorithm], 0, POLICY[on_error], 1) .. u32(limit) .. u32(window_ms)
    local after_cost = u32(local_limit or 0)
    return setmetatable({
        _limit = limit,
        _window_ms = window_ms,
        _algorithm = algorithm,
        _on_error = on_error,
        _local_limit = local_limit,
        _before_cost = before_cost,
        _after_cost = after_cost,
        -- The whole constant part for the usual cost of 1: one piece fewer.
        _cost_one = before_cost .. COST_ONE .. after_cost,
        -- The denial cache's keys: "\1<limit>|<window_ms>|<wire key>"
        -- (the log), "\1<algorithm>|<limit>|..." (the others: each has
        -- windows of its own). A wire key holds no control byte, so no
        -- local fallback key (which starts with the wire key) can be one.
        _deny_prefix = "\1" .. (algorithm == "log" and "" or algorithm .. "|") .. limit .. "|" .. window_ms .. "|",
    }, limiter_mt)
end

-- The table form does not build a limiter per call (measured: that alone
-- costs more than the whole call did before the object form): the limiters
-- of the option sets it has seen are kept by what goes into the frame
-- (policy and algorithm, limit, window_ms, local_limit), and its other options are read
-- from its own table at each call. Bounded: past CACHE_MAX limiters the cache
-- starts over, so limits computed per request cannot grow it without end.
local CACHE_MAX = 256
local cache, cached = {}, 0

local function cached_limiter(opts, on_error, algorithm)
    local limit, window_ms, local_limit = opts.limit, opts.window_ms, opts.local_limit
    local mode = algorithm == "log" and on_error or on_error .. "|" .. algorithm
    local by_limit = cache[mode]
    local by_window = by_limit and by_limit[limit]
    local by_local = by_window and by_window[window_ms]
    local lim = by_local and by_local[local_limit or 0]
    if lim then
        return lim
    end
    if cached >= CACHE_MAX then
        cache, cached = {}, 0
        by_limit, by_window, by_local = nil, nil, nil
    end
    if not by_limit then
        by_limit = {}
        cache[mode] = by_limit
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

local NEW_OPTIONS = {
    limit = true, window_ms = true, on_error = true, local_limit = true, status = true,
    fail_closed_status = true, invalid_status = true, headers = true, header_style = true, dry_run = true,
    denial_cache = true, algorithm = true, nodelay = true, delay = true,
}

local POLICY_OPTIONS = {
    policy = true, on_error = true, local_limit = true, window_ms = true, status = true,
    fail_closed_status = true, invalid_status = true, headers = true, header_style = true, dry_run = true,
}

-- A policy's name as ratelimitd.toml allows it: 1 to 31 of A-Z a-z 0-9 _ . -
local function valid_policy_name(name)
    return type(name) == "string" and #name >= 1 and #name <= MAX_POLICY_NAME_LEN and not find(name, "[^%w_.-]")
end

-- A limiter of a named policy: the daemon holds its limit, window,
-- overrides and allowlist (docs/POLICIES.md); the frame (op 2, CHECK_POLICY)
-- carries the name, the key and the cost. The location's on_error decides
-- when the daemon gives no decision, and when the name is unknown to it.
-- With on_error = "local", local_limit is the per-host quota and window_ms
-- the window of this client's own fallback (the daemon's fallback uses the
-- policy's window).
function new_policy(opts)
    for k in pairs(opts) do
        if not POLICY_OPTIONS[k] then
            if k == "limit" or k == "cost" or k == "key" or k == "algorithm" then
                return nil, "new: " .. k .. " is not an option of a policy limiter: the limit and algorithm are the policy's, in ratelimitd.toml; key and cost are given per request"
            end
            return nil, "new: unknown option '" .. tostring(k) .. "'"
        end
    end
    local name = opts.policy
    if not valid_policy_name(name) then
        return nil, "new: policy must be a name of 1 to " .. MAX_POLICY_NAME_LEN .. " characters A-Z a-z 0-9 _ . -"
    end
    local on_error, err = policy_options(opts)
    if not on_error then
        return nil, "new: " .. err
    end
    if on_error == "local" and not positive_int(opts.window_ms, 4294967295) then
        return nil, "new: on_error = 'local' needs window_ms: the window of this client's own fallback quota"
    end
    if opts.window_ms ~= nil and not positive_int(opts.window_ms, 4294967295) then
        return nil, "new: window_ms must be a positive integer"
    end
    local before_cost = "\0\0" .. char(POLICY[on_error], 1) .. u32(opts.local_limit or 0)
    local lim = setmetatable({
        _policy = name,
        _on_error = on_error,
        _local_limit = opts.local_limit,
        _window_ms = opts.window_ms,
        _before_cost = before_cost,
        _cost_one = before_cost .. COST_ONE,
        -- After the key length: the name's length and the name.
        _name_part = char(#name) .. name,
        _name_len = #name,
    }, limiter_mt)
    lim.status = opts.status
    lim.fail_closed_status = opts.fail_closed_status
    lim.invalid_status = opts.invalid_status
    lim.headers = opts.headers
    lim.header_style = opts.header_style
    lim.dry_run = opts.dry_run
    return lim
end

--- Makes a limiter: validates the options once and precomputes the constant
-- part of its request frame. Options as in the table form, without key and
-- cost (given per request to lim:limit(key, cost) and lim:check(key, cost)).
-- Returns the object, or nil and a message on a bad or unknown option.
-- Raises only when not given a table (a call as ratelimitd:new{} included):
-- that is a bug in the code, not in a value, as configure() raises for it.
function _M.new(opts)
    -- A string that cannot be a policy name (e.g. "limit=10") is a bug in
    -- the code, raised like any other non-table.
    if valid_policy_name(opts) then
        opts = { policy = opts }
    end
    if type(opts) ~= "table" or opts == _M then
        error("new: expects a policy name or a table of options: ratelimitd.new(\"order\"), ratelimitd.new{ limit = ..., window_ms = ... }", 2)
    end
    if opts.policies ~= nil or (opts.policy ~= nil and opts.refundable ~= nil) then
        return new_multi(opts)
    end
    if opts.policy ~= nil then
        return new_policy(opts)
    end
    for k in pairs(opts) do
        if not NEW_OPTIONS[k] then
            if k == "key" or k == "cost" then
                return nil, "new: " .. k .. " is given per request: lim:limit(key, cost)"
            end
            return nil, "new: unknown option '" .. tostring(k) .. "'"
        end
    end
    local err = limit_window_error(opts)
    if err then
        return nil, "new: " .. err
    end
    local on_error
    on_error, err = policy_options(opts)
    if not on_error then
        return nil, "new: " .. err
    end
    if opts.denial_cache ~= nil and type(opts.denial_cache) ~= "boolean" then
        return nil, "new: denial_cache must be a boolean"
    end
    local algorithm
    algorithm, err = algorithm_option(opts)
    if not algorithm then
        return nil, "new: " .. err
    end
    local lim = build(opts.limit, opts.window_ms, on_error, opts.local_limit, algorithm)
    -- nil: configure()'s denial_cache decides at each request.
    lim._denial_cache = opts.denial_cache
    lim.nodelay = opts.nodelay
    lim.delay = opts.delay
    lim.status = opts.status
    lim.fail_closed_status = opts.fail_closed_status
    lim.invalid_status = opts.invalid_status
    lim.headers = opts.headers
    lim.header_style = opts.header_style
    lim.dry_run = opts.dry_run
    return lim
end

-- Sends one frame and reads its response on a connected socket: the length
-- prefix and the fixed fields in one receive, the message (only with an
-- error code) in a second. Returns the 32 bytes of prefix and fixed fields
-- and the message, or nil and an error.
local function roundtrip(sock, frame, id)
    local bytes, err = sock:send(frame)
    if not bytes then
        return nil, "send: " .. err
    end
    local head
    head, err = sock:receive(RESPONSE_HEAD_LEN)
    if not head then
        return nil, "receive: " .. err
    end
    local len = be32(head, 1)
    if len < RESPONSE_FIXED_LEN or len > MAX_RESPONSE_LEN then
        return nil, "bad response length " .. len
    end
    if byte(head, 5) ~= VERSION or be32(head, 7) ~= id then
        return nil, "response out of sync"
    end
    local msg_len = be16(head, 31)
    if RESPONSE_FIXED_LEN + msg_len > len or not DECISION[byte(head, 11)] or not SOURCE[byte(head, 12)] then
        return nil, "malformed response"
    end
    local message, ext = "", nil
    if len > RESPONSE_FIXED_LEN then
        message, err = sock:receive(len - RESPONSE_FIXED_LEN)
        if not message then
            return nil, "receive: " .. err
        end
        if len > RESPONSE_FIXED_LEN + msg_len then
            -- The extension of a multi-item or refundable check (5b).
            ext = sub(message, msg_len + 1)
            message = sub(message, 1, msg_len)
        end
    end
    return head, message, ext
end

-- Errors that mean the daemon had closed the connection before it read the
-- request: safe to send again on a new connection.
local CLOSED_BEFORE_READ = {
    ["send: closed"] = true, ["send: broken pipe"] = true,
    ["receive: closed"] = true, ["receive: connection reset by peer"] = true,
}

-- A daemon that cannot be connected to at all (socket missing, permission
-- denied, a stale socket: errors that come back at once) is not tried again
-- by this worker for a while: each failed connect makes nginx's core log a
-- "connect() ... failed" line of its own, at crit or error level and per
-- request, which lua_socket_log_errors cannot turn off (it covers only the
-- cosocket layer's own lines). Without this, a stopped daemon wrote some
-- 50,000 lines (10 MB) in 3 s. While skipped, requests get the location's
-- policy at once with the last connect error; the pause starts at
-- CONNECT_RETRY_MIN and doubles on each failed retry up to CONNECT_RETRY_MAX,
-- so a daemon that is back is used again within that bound (one request per
-- worker tries it when the pause ends). Timeouts do not count: a slow
-- daemon is not a missing one.
local CONNECT_RETRY_MIN, CONNECT_RETRY_MAX = 0.05, 1 -- s
local transact, parse_extension
local connect_retry_at, connect_pause, connect_error = 0, 0, nil

-- One request/response exchange. Returns the parsed response, or nil and an
-- error; a socket is pooled only after a clean exchange, never after an error
-- or a timeout. `key` is the wire key, `cost` already checked.
local function exchange(self, key, cost, lease_op, lease)
    local n = #key
    if self._lease_policy then
        -- ACQUIRE_POLICY (PROTOCOL.md section 4e): CHECK_POLICY's header
        -- (the release flag in it), the lease id's length, the item (cost,
        -- key_len, name_len, name, key), then the lease id.
        local len = 22 + self._name_len + n + #lease
        local id = next_id()
        local frame = u32(len) .. char(VERSION, OP_ACQUIRE_POLICY) .. u32(id)
            .. (lease_op == OP_RELEASE and self._release_header or self._acquire_header) .. char(#lease)
            .. u32(cost) .. char(band(rshift(n, 8), 255), band(n, 255)) .. self._name_part .. key .. lease
        return transact(self, frame, id)
    end
    local policy = self._policy
    local len = lease_op and 29 + n + #lease or policy and 21 + self._name_len + n or 28 + n
    local id = next_id()
    -- Per request only the length, the id, the cost and the key are encoded:
    -- length, version, op and id in one string, then the limiter's constant
    -- parts. One concatenation, not a table of pieces: for four short pieces
    -- sock:send(table) walks the table three times through the C API, which
    -- measured no cheaper than LuaJIT's concatenation (docs/NGINX.md, section 4).
    local frame
    local head = char(band(rshift(len, 24), 255), band(rshift(len, 16), 255), band(rshift(len, 8), 255), band(len, 255),
                      VERSION, lease_op or (policy and OP_CHECK_POLICY or OP_CHECK),
                      band(rshift(id, 24), 255), band(rshift(id, 16), 255), band(rshift(id, 8), 255), band(id, 255))
    local key_len = char(band(rshift(n, 8), 255), band(n, 255))
    if lease_op then
        -- ACQUIRE / RELEASE (PROTOCOL.md section 4d): CHECK's fields (the
        -- lease length as window_ms), then the lease id's length, key, id.
        frame = head .. self._before_cost .. u32(cost) .. self._after_cost .. key_len .. char(#lease) .. key .. lease
    elseif policy then
        -- CHECK_POLICY, one item: cost, key_len, name_len, name, key.
        if cost == 1 then
            frame = head .. self._cost_one .. key_len .. self._name_part .. key
        else
            frame = head .. self._before_cost .. u32(cost) .. key_len .. self._name_part .. key
        end
    elseif cost == 1 then
        frame = head .. self._cost_one .. key_len .. key
    else
        frame = head .. self._before_cost .. u32(cost) .. self._after_cost .. key_len .. key
    end
    return transact(self, frame, id)
end

-- Sends `frame` (request `id`) and reads its answer, on a pooled
-- connection: the decision table, or nil and an error.
function transact(self, frame, id)
    local sock, head, message, ext, err
    for attempt = 1, 2 do
        sock, err = tcp()
        if not sock then
            return nil, "socket: " .. tostring(err)
        end
        if connect_error then
            local now = ngx_now()
            if now < connect_retry_at then
                return nil, connect_error
            end
            -- This request tries; the others of the worker keep skipping
            -- until it has failed again or succeeded.
            connect_retry_at = now + connect_pause
        end
        sock:settimeouts(config.connect_timeout, config.send_timeout, config.read_timeout)
        local ok
        ok, err = sock:connect(config.socket)
        if not ok then
            err = "connect: " .. err
            if err ~= "connect: timeout" then
                connect_pause = min(max(connect_pause * 2, CONNECT_RETRY_MIN), CONNECT_RETRY_MAX)
                connect_retry_at = ngx_now() + connect_pause
                connect_error = err
            end
            return nil, err
        end
        if connect_error then
            connect_error, connect_pause = nil, 0
        end
        local reused = (sock:getreusedtimes() or 0) > 0
        head, message, ext = roundtrip(sock, frame, id)
        if head then
            break
        end
        err = message
        sock:close()
        -- A pooled connection that the daemon closed while it sat idle (a
        -- daemon restart) fails at once; the request was never read, so it
        -- is sent once more on a fresh connection. Timeouts are not retried.
        if attempt == 2 or not reused or not CLOSED_BEFORE_READ[err] then
            return nil, err
        end
    end
    -- Offsets in `head` are the body's plus the 4 bytes of length prefix.
    local code = be16(head, 29)
    local source = SOURCE[byte(head, 12)]
    local decision = DECISION[byte(head, 11)]
    -- The one table of the request, made with every field it will hold
    -- (window_ms is added by limit()), so it is never resized.
    local count, remaining = be32(head, 13), be32(head, 17)
    local policy = self._policy
    local limit = source == "local" and self._local_limit or self._limit
    if policy then
        -- The policy's limit for this key (its override included) is the
        -- daemon's: count plus remaining, whenever something was counted.
        limit = (source == "redis" or source == "memory" or source == "denial_cache" or source == "local") and count + remaining or nil
    end
    local res = {
        -- A shadow policy's refusal is reported, never enforced.
        allowed = decision == "allowed" or decision == "shadow_denied",
        decision = decision,
        source = source,
        count = count,
        remaining = remaining,
        retry_after_ms = be32(head, 21),
        reset_ms = be32(head, 25),
        error_code = code,
        error = ERROR_NAME[code] or tostring(code),
        message = message,
        -- The daemon's local fallback counts against the local quota.
        limit = limit,
        policy = policy,
    }
    if ext and self._names then
        parse_extension(self, res, ext)
    end
    if code >= 20 and code < 30 then
        sock:close()
    else
        sock:setkeepalive(config.keepalive_timeout, config.pool_size)
    end
    return res
end

-- The denial cache (docs/NGINX.md, section 4): after the daemon refuses
-- (source redis or denial_cache) a key with this limit and window, later
-- requests for it of at least the refused cost are refused here, without a
-- round trip, until the daemon could admit them. Exact for the same reason
-- as the daemon's own cache: a refusal records nothing and counts only fall
-- by expiry, so Redis refuses such a request until the retry time. The
-- entry is anchored at the time the request was sent (taken before the send:
-- only earlier), ends 1 ms + 0.05 % early (Redis reads whole ms; clock rates)
-- and lives at most denial_cache_max_ms. Kept in shared_dict with safe_set:
-- it never evicts the local fallback's counters; when the dict is full, no
-- entry is made. Value: expiry, retry time and reset time (µs, monotonic),
-- count and remaining as the daemon answered; flags: the refused cost.
local function cached_refusal(self, dict, ckey, cost, now)
    local v, min_cost = dict:get(ckey)
    if not v or cost < min_cost or now >= be56(v, 1) then
        return nil
    end
    local retry = max(1, ceil((be56(v, 8) - now) / 1000) - 1)
    return {
        allowed = false,
        decision = "denied",
        source = "lua_denial_cache",
        count = be32(v, 22),
        remaining = be32(v, 26),
        retry_after_ms = retry,
        reset_ms = max(retry, ceil((be56(v, 15) - now) / 1000) - 1),
        error_code = 0,
        error = "OK",
        message = "",
        limit = self._limit,
    }
end

local function remember_refusal(dict, ckey, cost, res, sent)
    local r = res.retry_after_ms
    local max_ms = config.denial_cache_max_ms
    local life_ms = min(r - 1 - min(r, max_ms) / 2000, max_ms)
    if life_ms < 1 then
        return
    end
    local value = u56(sent + floor(life_ms * 1000)) .. u56(sent + r * 1000) .. u56(sent + res.reset_ms * 1000) .. u32(res.count) .. u32(res.remaining)
    -- The dict's own expiry (wall clock) only frees the memory; the
    -- monotonic expiry in the value decides.
    dict:safe_set(ckey, value, life_ms / 1000 + 0.001, cost)
end

-- One decision: from the denial cache, else from the daemon. `key` is the
-- wire key, `cost` already checked.
local function decide(self, key, cost)
    if self._concurrency then
        return exchange(self, key, cost, OP_ACQUIRE, ngx.ctx.ratelimitd_lease)
    end
    local on = self._denial_cache
    if on == nil then
        on = config.denial_cache
    end
    -- Policy limiters: the daemon's denial cache only (this one is keyed by
    -- limit and window, which the daemon holds and a reload may change).
    if not (on and mono_us) or self._policy then
        return exchange(self, key, cost)
    end
    local dict = ngx_shared[config.shared_dict]
    if not dict then
        return exchange(self, key, cost)
    end
    local ckey = self._deny_prefix .. key
    local sent = mono_us()
    local hit = cached_refusal(self, dict, ckey, cost, sent)
    if hit then
        return hit
    end
    local res, err = exchange(self, key, cost)
    if res and res.decision == "denied" and (res.source == "redis" or res.source == "denial_cache") then
        remember_refusal(dict, ckey, cost, res, sent)
    end
    return res, err
end

-- Per-request arguments of the object form: the same kind of bug as a bad
-- option of the table form, so raised the same way (level 3: the line that
-- called lim:limit or lim:check). Cheap: a few comparisons, no tables.
local function call_args(self, key, cost)
    if type(self) ~= "table" or self._cost_one == nil then
        error("call it as lim:limit(key, cost) / lim:check(key, cost), with a colon, on an object from new()", 3)
    end
    if type(key) ~= "string" or key == "" then
        error("key must be a non-empty string", 3)
    end
    if cost == nil then
        return 1
    end
    if self._policy then
        -- The policy's limit is the daemon's: a cost above it is refused as
        -- INVALID_COST (invalid_status); here only its form is checked.
        if type(cost) ~= "number" or cost < 1 or cost > 4294967295 or floor(cost) ~= cost then
            error("cost must be a positive integer", 3)
        end
        return cost
    end
    -- Above the limit a request can never be admitted; the daemon would
    -- refuse it (INVALID_COST) and the fail policy would decide, which for
    -- "open" lets it through. A bug in how the cost is computed, so raised.
    if type(cost) ~= "number" or cost < 1 or cost > self._limit or floor(cost) ~= cost then
        error("cost must be an integer from 1 to the limit (" .. self._limit .. ")", 3)
    end
    return cost
end

--- Asks the daemon for `key` (cost 1 by default). Returns a table { allowed,
-- decision, source, count, remaining, retry_after_ms, reset_ms, limit,
-- error_code, error, message }, or nil and a string when the daemon could not
-- be reached or answered badly.
function Limiter.check(self, key, cost)
    if type(self) == "table" and self._names then
        local keys, costs = multi_args(self, key, cost)
        return multi_exchange(self, keys, costs)
    end
    cost = call_args(self, key, cost)
    return decide(self, wire_key(key), cost)
end

--- Asks the daemon; table form of check (see docs/NGINX.md).
function _M.check(opts)
    local on_error, algorithm = check_opts(opts, 3)
    return decide(cached_limiter(opts, on_error, algorithm), wire_key(opts.key), opts.cost or 1)
end

-- Rate-limited per worker and per kind of failure, so an outage gives one
-- line per interval for each of fail_open, fail_closed, ... and a fail-open
-- is never hidden behind a fail-closed.
local last_log, suppressed = {}, {}

local function log_failure(what, key, reason)
    local now = ngx_now()
    if now - (last_log[what] or 0) < config.log_interval then
        suppressed[what] = (suppressed[what] or 0) + 1
        return
    end
    last_log[what] = now
    -- At error level: Debian's default error_log keeps only errors, and an
    -- operator must see (and can alert on) every kind of fail-open. The key
    -- is logged as sent: no control bytes from request headers reach the log.
    ngx_log(ERR, "ratelimitd: ", what, " key=", key, " reason=\"", reason, "\" suppressed=", suppressed[what] or 0)
    suppressed[what] = 0
end

-- The fallback when the daemon gives no decision: an approximate sliding
-- window per host (the previous fixed window weighted by its overlap, plus
-- the current one) in a lua_shared_dict shared by all workers.
local function local_decision(self, key, cost)
    local dict = ngx_shared[config.shared_dict]
    if not dict then
        return nil, "lua_shared_dict '" .. config.shared_dict .. "' is not defined"
    end
    local window = self._window_ms
    local limit = self._local_limit
    local now = ngx_now() * 1000
    local start = floor(now / window) * window
    local cur_key = format("%s|%d|%d", key, window, start)
    local prev = dict:get(format("%s|%d|%d", key, window, start - window)) or 0
    local weighted = floor(prev * (window - (now - start)) / window)
    local reset_ms = ceil(start + window - now)
    -- Take the cost first and give it back if it does not fit: the shared
    -- dict's incr is atomic across workers, a read-then-write would not be.
    local cur, err, forcible = dict:incr(cur_key, cost, 0, 2 * window / 1000)
    if not cur then
        return nil, "shared dict: " .. err
    end
    if forcible then
        log_failure("shared_dict_full", key, "lua_shared_dict '" .. config.shared_dict .. "' evicted entries: enlarge it")
    end
    if weighted + cur > limit then
        dict:incr(cur_key, -cost)
        local count = weighted + cur - cost
        return { allowed = false, decision = "denied", source = "lua_local", count = count,
                 remaining = max(limit - count, 0), retry_after_ms = reset_ms, reset_ms = reset_ms, limit = limit }
    end
    return { allowed = true, decision = "allowed", source = "lua_local", count = weighted + cur,
             remaining = limit - weighted - cur, retry_after_ms = 0, reset_ms = reset_ms, limit = limit }
end

-- What the location's policy decides when the daemon gave no decision.
local function fallback(self, key, cost, reason)
    local on_error = self._on_error
    if on_error == "open" then
        log_failure("fail_open", key, reason)
        return { allowed = true, decision = "allowed", source = "lua_fail_open", limit = self._limit }
    end
    if on_error == "local" then
        local res, err = local_decision(self, key, cost)
        if res then
            log_failure("local_fallback", key, reason)
            return res
        end
        reason = reason .. "; local fallback: " .. err
    end
    log_failure("fail_closed", key, reason)
    return { allowed = false, decision = "denied", source = "lua_fail_closed", limit = self._limit,
             retry_after_ms = 1000 }
end

-- Sources whose numbers come from a real count; after a fail-open or
-- fail-closed nothing was counted, so no quota is promised (nor for an
-- exempt key: none applies).
local COUNTED = { redis = true, memory = true, ["local"] = true, lua_local = true, denial_cache = true, lua_denial_cache = true }

local set_draft_headers, log_outcome, refuse

local function set_headers(res, style)
    if not COUNTED[res.source] then
        return
    end
    local remaining = res.remaining
    local reset = ceil((res.reset_ms or 0) / 1000)
    if not res.limit then
        return
    end
    if style == "draft" then
        -- One list member per policy (docs/NGINX.md, RateLimit headers).
        return set_draft_headers(res)
    elseif style == "x" then
        ngx_header["X-RateLimit-Limit"] = res.limit
        ngx_header["X-RateLimit-Remaining"] = remaining
        ngx_header["X-RateLimit-Reset"] = reset
    else
        ngx_header["RateLimit-Limit"] = res.limit
        ngx_header["RateLimit-Remaining"] = remaining
        ngx_header["RateLimit-Reset"] = reset
    end
end

-- The access-phase decision of both forms. `key` is the wire key (computed
-- once by the caller), `cost` already checked; `beh` holds status,
-- fail_closed_status, headers, header_style and dry_run: the object itself,
-- or the options table of the table form.
local function enforce(self, beh, key, cost)
    local res, err = decide(self, key, cost)
    if not res then
        res = fallback(self, key, cost, err)
    elseif res.error_code == UNKNOWN_POLICY then
        -- The daemon's configuration has no policy of this name (a typo, or
        -- a reload that removed it): a configuration error, logged as such
        -- at error level; until it is fixed the location's on_error decides.
        log_failure("unknown_policy", key, "policy '" .. tostring(self._policy) .. "': " .. res.message)
        res = fallback(self, key, cost, "UNKNOWN_POLICY")
    elseif res.decision == "error" and res.error_code < 30 then
        -- The daemon refused the request as invalid (codes 1-29: a limit,
        -- window or cost outside its bounds): this location is misconfigured.
        -- That is not an outage, so on_error does not decide (with "open" it
        -- would pass every request unlimited): the request gets its own
        -- status, 500 by default, and the error is logged as such.
        log_failure("invalid_request", key, res.error .. ": " .. res.message)
        if beh.dry_run then
            return res
        end
        return ngx_exit(beh.invalid_status or config.invalid_status)
    elseif res.decision == "error" then
        -- No decision for a reason of the daemon's own (its in-memory
        -- windows are full: LOCAL_CAPACITY): decided by the policy.
        res = fallback(self, key, cost, res.error .. ": " .. res.message)
    elseif res.source == "fail_open" or res.source == "fail_closed" or res.source == "local" then
        -- Redis failed behind the daemon, which applied this location's policy.
        log_failure("daemon_" .. res.source, key, res.error .. ": " .. res.message)
    end
    -- A policy's window is the daemon's (unknown here); window_ms of a
    -- policy limiter is its own fallback's, for its own fallback only.
    if not self._policy or res.source == "lua_local" then
        res.window_ms = self._window_ms
    end
    local headers = beh.headers
    if headers == nil then
        headers = config.headers
    end
    if res.decision == "shadow_denied" then
        -- Nothing the client should see: no headers, no refusal.
        ngx_log(INFO, "ratelimitd: shadow policy '", self._policy, "' would deny key=", key, " source=", res.source)
        log_outcome(self, res, "PASSED_SHADOW")
        return res
    end
    if headers then
        set_headers(res, beh.header_style or config.header_style)
    end
    if res.allowed then
        -- GCRA: an admitted request's retry_after_ms is its place at the
        -- rate. Paced unless nodelay; the first `delay` of a burst at once.
        local wait = res.retry_after_ms
        local delayed = false
        if self._algorithm == "gcra" and wait and wait > 0 and not beh.nodelay and not beh.dry_run then
            wait = wait - (beh.delay or 0) * self._window_ms / self._limit
            if wait > 0 then
                ngx_sleep(wait / 1000)
                delayed = true
            end
        end
        -- DELAYED as limit_req's $limit_req_status says of a paced request.
        log_outcome(self, res, (res.source == "fail_open" or res.source == "lua_fail_open") and "FAIL_OPEN" or (delayed and "DELAYED" or "PASSED"))
        return res
    end
    if beh.dry_run then
        ngx_log(INFO, "ratelimitd: dry_run would deny key=", key, " source=", res.source)
        log_outcome(self, res, "REJECTED_DRY_RUN")
        return res
    end
    log_outcome(self, res, "REJECTED")
    local closed = res.source == "fail_closed" or res.source == "lua_fail_closed"
    if headers or closed then
        ngx_header["Retry-After"] = max(1, ceil((res.retry_after_ms or 1000) / 1000))
    end
    if closed then
        return ngx_exit(beh.fail_closed_status or config.fail_closed_status)
    end
    return refuse(beh, res, beh.status or config.status)
end


-- Several policies in one request, all or nothing, and refunds
-- (docs/POLICIES.md; PROTOCOL.md 4b, 4c, 5b).
--
--   api = assert(ratelimitd.new{ policies = { "per_ip", "per_tenant", "global" },
--                                on_error = "closed", refundable = true })
--   local res = api:limit({ ngx.var.remote_addr, tenant, "all" })   -- keys in policy order
--   ... log_by_lua: ratelimitd.refund(res.handle)
--
-- A one-policy limiter with refundable = true is the same object
-- (new{ policy = "login", refundable = true }; its key may be a string).

local MULTI_OPTIONS = {
    policies = true, policy = true, refundable = true, on_error = true, local_limit = true, window_ms = true,
    status = true, fail_closed_status = true, invalid_status = true, headers = true, header_style = true, dry_run = true,
}

function new_multi(opts)
    for k in pairs(opts) do
        if not MULTI_OPTIONS[k] then
            return nil, "new: unknown option '" .. tostring(k) .. "' for a policy limiter"
        end
    end
    local names = opts.policies
    if names == nil then
        names = { opts.policy }
    elseif opts.policy ~= nil then
        return nil, "new: give policy or policies, not both"
    end
    if type(names) ~= "table" or #names < 1 or #names > MAX_POLICY_ITEMS then
        return nil, "new: policies must be a list of 1 to " .. MAX_POLICY_ITEMS .. " policy names"
    end
    local parts, seen = {}, {}
    for i, name in ipairs(names) do
        if not valid_policy_name(name) then
            return nil, "new: policy must be a name of 1 to " .. MAX_POLICY_NAME_LEN .. " characters A-Z a-z 0-9 _ . -"
        end
        if seen[name] then
            return nil, "new: policy '" .. name .. "' is listed twice"
        end
        seen[name] = true
        parts[i] = char(#name) .. name
    end
    if opts.refundable ~= nil and type(opts.refundable) ~= "boolean" then
        return nil, "new: refundable must be a boolean"
    end
    local on_error, err = policy_options(opts)
    if not on_error then
        return nil, "new: " .. err
    end
    if on_error == "local" and not positive_int(opts.window_ms, 4294967295) then
        return nil, "new: on_error = 'local' needs window_ms: the window of this client's own fallback quota"
    end
    local flags = opts.refundable and FLAG_REFUNDABLE or 0
    local lim = setmetatable({
        _names = names,
        _n = #names,
        _policy = names[1],
        _on_error = on_error,
        _local_limit = opts.local_limit,
        _window_ms = opts.window_ms,
        -- After length, version, op and id: flags, fail policy, n_items, local_limit.
        _header = char(0, flags, POLICY[on_error], #names) .. u32(opts.local_limit or 0),
        _name_parts = parts,
        _cost_one = true,
    }, limiter_mt)
    lim.status = opts.status
    lim.fail_closed_status = opts.fail_closed_status
    lim.invalid_status = opts.invalid_status
    lim.headers = opts.headers
    lim.header_style = opts.header_style
    lim.dry_run = opts.dry_run
    return lim
end

-- The items of one request: keys (wire keys) and costs in policy order.
local function multi_items(self, keys, costs)
    local parts = {}
    for i = 1, self._n do
        local key, cost = keys[i], costs[i]
        local n = #key
        parts[i] = u32(cost) .. char(band(rshift(n, 8), 255), band(n, 255)) .. self._name_parts[i] .. key
    end
    return concat(parts)
end

function multi_exchange(self, keys, costs)
    local items = multi_items(self, keys, costs)
    local id = next_id()
    local len = 14 + #items
    local frame = u32(len) .. char(VERSION, OP_CHECK_POLICY) .. u32(id) .. self._header .. items
    local res, err = transact(self, frame, id)
    if res and res.handle then
        -- The refund frame repeats the items after the handle.
        res.handle = char(self._n) .. res.handle .. items
    end
    return res, err
end

-- Fills res.items (one table per policy: policy, decision, source, count,
-- remaining, retry_after_ms, reset_ms, limit, window_ms), res.refused (the
-- name of the policy that refused) and res.handle (16 bytes, or false).
function parse_extension(self, res, ext)
    local n, refused, handle_len = byte(ext, 1, 3)
    local items = {}
    local at = 4 + handle_len
    for i = 1, n do
        items[i] = {
            policy = self._names[i],
            decision = DECISION[byte(ext, at)] or "error",
            source = SOURCE[byte(ext, at + 1)] or "none",
            count = be32(ext, at + 2),
            remaining = be32(ext, at + 6),
            retry_after_ms = be32(ext, at + 10),
            reset_ms = be32(ext, at + 14),
            limit = be32(ext, at + 18),
            window_ms = be32(ext, at + 22),
        }
        at = at + 26
    end
    res.items = items
    res.refused = refused > 0 and self._names[refused] or false
    res.handle = handle_len > 0 and sub(ext, 4, 3 + handle_len) or false
    res.policy = res.refused or self._names[1]
    -- The legacy headers show the refusing item, else the most constrained.
    local main = items[refused]
    if not main then
        for _, it in ipairs(items) do
            if it.decision == "allowed" and it.source ~= "exempt" and (not main or it.remaining < main.remaining) then
                main = it
            end
        end
    end
    res.limit = main and main.limit > 0 and main.limit or nil
    res.window_ms = main and main.window_ms or nil
end

-- When the daemon gives no decision: the location's on_error for the whole
-- request; "local" checks each key in the per-host fallback and gives back
-- what it took when one refuses (approximate, like the one-key fallback).
local function multi_fallback(self, keys, costs, reason)
    local label = concat(keys, ",")
    if self._on_error ~= "local" then
        return fallback(self, label, 1, reason)
    end
    local dict = ngx_shared[config.shared_dict]
    local taken = {}
    for i = 1, self._n do
        local res, err = local_decision(self, self._names[i] .. "|" .. keys[i], costs[i])
        if not res or not res.allowed then
            for j = 1, #taken do
                local t = taken[j]
                local window = self._window_ms
                local start = floor(ngx_now() * 1000 / window) * window
                dict:incr(format("%s|%d|%d", t[1], window, start), -t[2])
            end
            if not res then
                return fallback(self, label, 1, reason .. "; local fallback: " .. err)
            end
            log_failure("local_fallback", label, reason)
            res.policy = self._names[i]
            return res
        end
        taken[#taken + 1] = { self._names[i] .. "|" .. keys[i], costs[i] }
    end
    log_failure("local_fallback", label, reason)
    return { allowed = true, decision = "allowed", source = "lua_local", limit = self._local_limit }
end

function multi_args(self, keys, cost)
    if type(self) ~= "table" or not self._names then
        error("call it as lim:limit(keys, cost), with a colon, on an object from new{ policies = ... }", 3)
    end
    if type(keys) == "string" and self._n == 1 then
        keys = { keys }
    end
    if type(keys) ~= "table" or #keys ~= self._n then
        error("keys must be a list of " .. self._n .. " non-empty strings, one per policy", 3)
    end
    local wire, costs = {}, {}
    for i = 1, self._n do
        local key = keys[i]
        if type(key) ~= "string" or key == "" then
            error("keys must be a list of " .. self._n .. " non-empty strings, one per policy", 3)
        end
        wire[i] = wire_key(key)
        local c = cost
        if type(cost) == "table" then
            c = cost[i]
        end
        if c == nil then
            c = 1
        end
        if type(c) ~= "number" or c < 1 or c > 4294967295 or floor(c) ~= c then
            error("cost must be a positive integer, or a list of them", 3)
        end
        costs[i] = c
    end
    return wire, costs
end

-- Sets the RateLimit-Policy and RateLimit fields of the current draft
-- (draft-ietf-httpapi-ratelimit-headers-12): one list member per policy
-- that counted, named by the policy; w only for a whole number of seconds;
-- t of a refusing policy is its retry-after, the value of Retry-After.
function set_draft_headers(res)
    local items = res.items
    if not items then
        items = { { policy = res.policy or "default", source = res.source, decision = res.decision, limit = res.limit,
                    window_ms = res.window_ms, remaining = res.remaining, retry_after_ms = res.retry_after_ms, reset_ms = res.reset_ms } }
    end
    local policies, states = {}, {}
    for _, it in ipairs(items) do
        if COUNTED[it.source] and it.limit and it.limit > 0 then
            local w = it.window_ms
            local name = format("%q", it.policy)
            if w and w % 1000 == 0 then
                policies[#policies + 1] = format("%s;q=%d;w=%d", name, it.limit, w / 1000)
            else
                policies[#policies + 1] = format("%s;q=%d", name, it.limit)
            end
            local t = it.decision == "denied" and it.retry_after_ms or it.reset_ms or 0
            states[#states + 1] = format("%s;r=%d;t=%d", name, it.remaining or 0, ceil(t / 1000))
        end
    end
    if #policies > 0 then
        ngx_header["RateLimit-Policy"] = concat(policies, ", ")
        ngx_header["RateLimit"] = concat(states, ", ")
    end
end

-- The problem type of a refusal in the draft, with the violated policies.
local PROBLEM_TYPE = "https://iana.org/assignments/http-problem-types#quota-exceeded"

local function problem_body(res, status)
    local violated = {}
    if res.items then
        for _, it in ipairs(res.items) do
            if it.decision == "denied" and it.source ~= "none" then
                violated[#violated + 1] = format("%q", it.policy)
            end
        end
    else
        violated[1] = format("%q", res.policy or "default")
    end
    return format('{"type":"%s","title":"Request cannot be satisfied as assigned quota has been exceeded","status":%d,"violated-policies":[%s]}\n',
                  PROBLEM_TYPE, status, concat(violated, ","))
end

-- The outcome for access logs and later phases: ngx.ctx.ratelimitd (the
-- decision table) from multi-policy and refundable limiters, or from every
-- limiter with configure{ set_ctx = true } (ngx.ctx makes a table per
-- request: not done unless asked); with configure{ log_var = "name" },
-- $name set to PASSED, REJECTED, REJECTED_DRY_RUN, PASSED_SHADOW, FAIL_OPEN
-- or ERROR (like $limit_req_status).
function log_outcome(self, res, outcome)
    if self._names or config.set_ctx then
        ngx.ctx.ratelimitd = res
    end
    local var = config.log_var
    if var ~= "" then
        ngx.var[var] = outcome
    end
end

-- Ends a refused request with `status`: headers set, the problem body if
-- configured.
function refuse(beh, res, status)
    if config.problem_body and status == (beh.status or config.status) then
        ngx.status = status
        ngx_header["Content-Type"] = "application/problem+json"
        ngx.print(problem_body(res, status))
        return ngx_exit(status)
    end
    return ngx_exit(status)
end

local function enforce_multi(self, keys, costs)
    local res, err = multi_exchange(self, keys, costs)
    local label = concat(keys, ",")
    if not res then
        res = multi_fallback(self, keys, costs, err)
    elseif res.error_code == UNKNOWN_POLICY then
        log_failure("unknown_policy", label, res.message)
        res = multi_fallback(self, keys, costs, "UNKNOWN_POLICY")
    elseif res.decision == "error" and res.error_code < 30 then
        log_failure("invalid_request", label, res.error .. ": " .. res.message)
        log_outcome(self, res, "ERROR")
        if self.dry_run then
            return res
        end
        return ngx_exit(self.invalid_status or config.invalid_status)
    elseif res.decision == "error" then
        res = multi_fallback(self, keys, costs, res.error .. ": " .. res.message)
    elseif res.error_code >= 30 then
        log_failure("daemon_" .. res.source, label, res.error .. ": " .. res.message)
    end
    local headers = self.headers
    if headers == nil then
        headers = config.headers
    end
    if headers then
        local style = self.header_style or config.header_style
        if style == "draft" then
            set_draft_headers(res)
        else
            set_headers(res, style)
        end
    end
    if res.allowed then
        log_outcome(self, res, (res.source == "fail_open" or res.source == "lua_fail_open") and "FAIL_OPEN" or "PASSED")
        return res
    end
    if self.dry_run then
        log_outcome(self, res, "REJECTED_DRY_RUN")
        return res
    end
    log_outcome(self, res, "REJECTED")
    local closed = res.source == "fail_closed" or res.source == "lua_fail_closed"
    if headers or closed then
        ngx_header["Retry-After"] = max(1, ceil((res.retry_after_ms or 1000) / 1000))
    end
    return refuse(self, res, closed and (self.fail_closed_status or config.fail_closed_status) or (self.status or config.status))
end

-- Sends a REFUND frame: true and the number of admission units taken back,
-- or nil and an error.
local function send_refund(handle)
    local id = next_id()
    -- Version, op, id, flags (0), a reserved byte, then the handle: item
    -- count, the 16 bytes of the daemon's handle and the check's items.
    local body = char(VERSION, OP_REFUND) .. u32(id) .. char(0, 0, 0) .. handle
    local frame = u32(#body) .. body
    local res, err = transact({ _names = false }, frame, id)
    if not res then
        return nil, err
    end
    if res.decision ~= "allowed" then
        return nil, res.error .. ": " .. res.message
    end
    return true, res.count
end

local function refund_timer(premature, handle)
    if premature then
        return
    end
    local ok, err = send_refund(handle)
    if not ok then
        log_failure("refund_failed", "-", err)
    end
end

-- Phases where cosockets are not available: the refund runs in a timer.
local NO_COSOCKET = { log = true, header_filter = true, body_filter = true, set = true, init_worker = true }

--- Takes back the admissions of a refundable check (res.handle): exact and
-- idempotent in Redis, harmless once they have left their windows. From
-- log_by_lua* (where cosockets are unavailable) it runs in a 0-delay timer
-- and returns true at once; elsewhere it returns true, units taken back; or
-- nil and an error. A false/nil handle (nothing was recorded) is a no-op.
function _M.refund(handle)
    if not handle then
        return true, 0
    end
    if type(handle) ~= "string" or #handle < 17 + 7 then
        error("refund: expects the handle of a refundable check (res.handle)", 2)
    end
    if NO_COSOCKET[ngx.get_phase()] then
        local ok, err = ngx.timer.at(0, refund_timer, handle)
        if not ok then
            return nil, "refund: timer: " .. err
        end
        return true
    end
    return send_refund(handle)
end

--- For access_by_lua*: lets the request through, or ends it with the
-- limiter's `status` (429 by default; 503 when the policy is closed and
-- nothing could decide). Returns the decision table (after a pass, or in dry
-- run).
function Limiter.limit(self, key, cost)
    if type(self) == "table" and self._names then
        local keys, costs = multi_args(self, key, cost)
        return enforce_multi(self, keys, costs)
    end
    cost = call_args(self, key, cost)
    return enforce(self, self, wire_key(key), cost)
end

--- Table form of limit, for access_by_lua*. Options: key, limit, window_ms,
-- cost, on_error, local_limit, status, fail_closed_status, headers,
-- header_style, dry_run. Validates them on every call (raising on a bad one)
-- and builds a limiter for the call.
function _M.limit(opts)
    local on_error, algorithm = check_opts(opts, 3)
    return enforce(cached_limiter(opts, on_error, algorithm), opts, wire_key(opts.key), opts.cost or 1)
end

-- Concurrency limits (docs/ALGORITHMS.md, "Concurrency"): at most `limit`
-- requests in flight per key across every host.
--
--   init_by_lua_block    { conns = assert(require("resty.ratelimitd").concurrency{ limit = 10, lease_ms = 60000 }) }
--                        -- or of a named policy (algorithm = "concurrency"):
--                        { uploads = assert(require("resty.ratelimitd").concurrency{ policy = "uploads" }) }
--   access_by_lua_block  { conns:enter(ngx.var.http_x_tenant_id) }
--   log_by_lua_block     { require("resty.ratelimitd").leave() }
--
-- enter() acquires a lease named by $request_id (refused: 429, as limit());
-- leave(), in the log phase, which runs for every request, aborted ones
-- included, releases the request's leases from a timer (cosockets are not
-- available in the log phase). A lease never released (nginx killed, the
-- daemon unreachable then) stops counting lease_ms after it was taken.
local CONCURRENCY_OPTIONS = {
    limit = true, lease_ms = true, on_error = true, local_limit = true, status = true,
    fail_closed_status = true, invalid_status = true, headers = true, header_style = true, dry_run = true,
}

local CONCURRENCY_POLICY_OPTIONS = {
    policy = true, lease_ms = true, on_error = true, local_limit = true, status = true,
    fail_closed_status = true, invalid_status = true, headers = true, header_style = true, dry_run = true,
}

-- A concurrency limiter of a named `[[policy]]` (algorithm = "concurrency",
-- docs/POLICIES.md): the daemon holds its limit, lease, overrides and
-- allowlist; the frame (op 7) carries the name, the key, the cost and the
-- lease id. With on_error = "local", local_limit is the per-host quota and
-- lease_ms the window of this client's own fallback.
local function concurrency_policy(opts)
    for k in pairs(opts) do
        if not CONCURRENCY_POLICY_OPTIONS[k] then
            if k == "limit" then
                return nil, "concurrency: limit is not an option of a policy limiter: the limit and lease are the policy's, in ratelimitd.toml"
            end
            return nil, "concurrency: unknown option '" .. tostring(k) .. "'"
        end
    end
    local name = opts.policy
    if not valid_policy_name(name) then
        return nil, "concurrency: policy must be a name of 1 to " .. MAX_POLICY_NAME_LEN .. " characters A-Z a-z 0-9 _ . -"
    end
    local on_error, err = policy_options(opts)
    if not on_error then
        return nil, "concurrency: " .. err
    end
    if opts.lease_ms ~= nil and not positive_int(opts.lease_ms, 4294967295) then
        return nil, "concurrency: lease_ms must be a positive integer"
    end
    if on_error == "local" and opts.lease_ms == nil then
        return nil, "concurrency: on_error = 'local' needs lease_ms: the window of this client's own fallback quota"
    end
    local header = char(POLICY[on_error], 1) .. u32(opts.local_limit or 0)
    local lim = setmetatable({
        _concurrency = true,
        _lease_policy = true,
        _policy = name,
        _on_error = on_error,
        _local_limit = opts.local_limit,
        _window_ms = opts.lease_ms,
        _acquire_header = char(0, 0) .. header,
        _release_header = char(0, FLAG_RELEASE) .. header,
        _name_part = char(#name) .. name,
        _name_len = #name,
        -- Unused by op 7's frame; marks an object from a constructor (call_args).
        _cost_one = COST_ONE,
    }, limiter_mt)
    lim.status = opts.status
    lim.fail_closed_status = opts.fail_closed_status
    lim.invalid_status = opts.invalid_status
    lim.headers = opts.headers
    lim.header_style = opts.header_style
    lim.dry_run = opts.dry_run
    return lim
end

function _M.concurrency(opts)
    if type(opts) ~= "table" or opts == _M then
        error("concurrency: expects a table of options", 2)
    end
    if opts.policy ~= nil then
        return concurrency_policy(opts)
    end
    for k in pairs(opts) do
        if not CONCURRENCY_OPTIONS[k] then
            return nil, "concurrency: unknown option '" .. tostring(k) .. "'"
        end
    end
    if not positive_int(opts.limit, 4294967295) then
        return nil, "concurrency: limit must be a positive integer"
    end
    if not positive_int(opts.lease_ms, 4294967295) then
        return nil, "concurrency: lease_ms must be a positive integer (how long a lease never released holds its slot)"
    end
    local on_error, err = policy_options(opts)
    if not on_error then
        return nil, "concurrency: " .. err
    end
    local lim = build(opts.limit, opts.lease_ms, on_error, opts.local_limit, "log")
    lim._concurrency = true
    lim.status = opts.status
    lim.fail_closed_status = opts.fail_closed_status
    lim.invalid_status = opts.invalid_status
    lim.headers = opts.headers
    lim.header_style = opts.header_style
    lim.dry_run = opts.dry_run
    return lim
end

-- Sources under which the daemon holds a lease to give back.
local LEASED = { redis = true, memory = true, ["local"] = true }

--- For access_by_lua*: acquires a slot of a concurrency limiter for this
-- request, or ends it as limit() does. Returns the decision table.
function Limiter.enter(self, key, cost)
    if type(self) ~= "table" or not self._concurrency then
        error("enter() is a method of a limiter from ratelimitd.concurrency{}: conns:enter(key)", 2)
    end
    cost = call_args(self, key, cost)
    local wkey = wire_key(key)
    -- The lease is named by nginx's $request_id (random, 32 hex digits),
    -- read once: unless the configuration indexes $request_id, each read
    -- of ngx.var.request_id makes a new one.
    local ctx = ngx.ctx
    if not ctx.ratelimitd_lease then
        ctx.ratelimitd_lease = ngx.var.request_id
    end
    local res = enforce(self, self, wkey, cost)
    if res and res.allowed and LEASED[res.source] then
        local held = ctx.ratelimitd_leases
        if not held then
            held = {}
            ctx.ratelimitd_leases = held
        end
        held[#held + 1] = { self, wkey, cost }
    end
    return res
end

local function release_all(premature, held, lease)
    for _, h in ipairs(held) do
        local res, err = exchange(h[1], h[2], h[3], OP_RELEASE, lease)
        if not res then
            log_failure("release", h[2], tostring(err) .. " (the lease expires after lease_ms)")
        elseif res.decision == "error" then
            log_failure("release", h[2], res.error .. ": " .. res.message)
        end
    end
end

--- For log_by_lua*: releases every lease enter() took for this request.
function _M.leave()
    local ctx = ngx.ctx
    local held = ctx.ratelimitd_leases
    if not held then
        return
    end
    ctx.ratelimitd_leases = nil
    local ok, err = ngx.timer.at(0, release_all, held, ctx.ratelimitd_lease)
    if not ok then
        log_failure("release", held[1][2], "timer: " .. tostring(err) .. " (the lease expires after lease_ms)")
    end
end

return _M

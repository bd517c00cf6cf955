-- resty.ratelimitd.config: the worker's settings and its log. The
-- settings every limiter reads at each request (configure{}), and their
-- validation: the settings table is changed in place, so modules may keep
-- a reference to it. The client's failure lines, rate-limited per worker
-- and per kind by log_interval, so an outage gives one line per interval
-- for each of fail_open, fail_closed, ... and a fail-open is never hidden
-- behind a fail-closed; and the lines said once per host when limiters
-- are made.

local floor = math.floor
local type, error, tostring, pairs, ipairs = type, error, tostring, pairs, ipairs
local sub = string.sub
local ngx = ngx
local ngx_log, ngx_now, ERR, WARN = ngx.log, ngx.now, ngx.ERR, ngx.WARN

local _M = {}

local settings = {
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
    shares = true,            -- a hot key of a policy or inline (log) limiter is
                              -- admitted from worker shares of the daemon's
                              -- quota leases in shared_dict, no round trip
                              -- (share.lua; a limiter's share_dict overrides)
    problem_body = false,     -- a refusal's body: application/problem+json, the
                              -- draft's quota-exceeded type with violated-policies
    log_var = "",             -- name of an nginx variable (declared with set) that
                              -- limit() sets to its outcome, for access logs
    set_ctx = false,          -- every limiter's limit() stores its decision in
                              -- ngx.ctx.ratelimitd (multi-policy and refundable
                              -- limiters always do)
}
_M.settings = settings

local KNOWN = {}
for k in pairs(settings) do
    KNOWN[k] = true
end

_M.HEADER_STYLES = { ratelimit = true, draft = true, x = true }

local POSITIVE = { "connect_timeout", "send_timeout", "read_timeout", "pool_size", "keepalive_timeout", "max_key_len", "denial_cache_max_ms" }
local STATUSES = { "status", "fail_closed_status", "invalid_status" }

-- The first problem with `opts`, or nil.
local function problem(opts)
    if type(opts) ~= "table" then
        return "expects a table"
    end
    for k, v in pairs(opts) do
        if not KNOWN[k] then
            return "unknown option '" .. tostring(k) .. "'"
        end
        if type(v) ~= type(settings[k]) then
            return "option '" .. k .. "' must be a " .. type(settings[k])
        end
    end
    if opts.header_style and not _M.HEADER_STYLES[opts.header_style] then
        return "header_style must be 'ratelimit', 'draft' or 'x'"
    end
    for _, k in ipairs(POSITIVE) do
        if opts[k] ~= nil and (opts[k] < 1 or floor(opts[k]) ~= opts[k]) then
            return k .. " must be a positive integer"
        end
    end
    for _, k in ipairs(STATUSES) do
        if opts[k] ~= nil and not (opts[k] >= 200 and opts[k] <= 599 and floor(opts[k]) == opts[k]) then
            return k .. " must be an HTTP status (200-599)"
        end
    end
    if opts.denial_cache_max_ms ~= nil and opts.denial_cache_max_ms > 60000 then
        return "denial_cache_max_ms must be at most 60000"
    end
    if opts.log_interval ~= nil and opts.log_interval < 0 then
        return "log_interval must not be negative"
    end
end

--- Sets defaults for every later call; call once from init_by_lua*.
-- Limiters read these at each request, so configure() may run before or
-- after they are created. Raises on a bad option (a bug in the code).
function _M.configure(opts)
    local err = problem(opts)
    if err then
        error("configure: " .. err, 2)
    end
    for k, v in pairs(opts) do
        settings[k] = v
    end
    if sub(settings.socket, 1, 5) ~= "unix:" then
        settings.socket = "unix:" .. settings.socket
    end
    return true
end

local last_log, suppressed = {}, {}

--- One failure line of kind `what` for `key`; `policy`: the named policy
-- of the limiter (nil for an inline one), so that every line about a
-- policy limiter names its policy.
function _M.failure(what, key, reason, policy)
    local now = ngx_now()
    if now - (last_log[what] or 0) < settings.log_interval then
        suppressed[what] = (suppressed[what] or 0) + 1
        return
    end
    last_log[what] = now
    -- At error level: Debian's default error_log keeps only errors, and an
    -- operator must see (and can alert on) every kind of fail-open. The key
    -- is logged as sent: no control bytes from request headers reach the log.
    if policy then
        ngx_log(ERR, "ratelimitd: ", what, " policy=", policy, " key=", key, " reason=\"", reason, "\" suppressed=", suppressed[what] or 0)
    else
        ngx_log(ERR, "ratelimitd: ", what, " key=", key, " reason=\"", reason, "\" suppressed=", suppressed[what] or 0)
    end
    suppressed[what] = 0
end

--- Whether this process says the lines that are one per host, not one per
-- worker: worker 0, or the master (init_by_lua, where ngx.worker.id() is nil).
function _M.loud()
    local id = ngx.worker and ngx.worker.id and ngx.worker.id()
    return id == nil or id == 0
end

local said_default = {}

--- Says once per host that the limiter `what` fails open because its
-- location chose no on_error (and, for a policy limiter, neither did the
-- policy): the default is open, as Envoy's failure_mode_deny = false, and
-- never silent (docs/CONFIG.md, "on_error"). At warn level: a default, not
-- a fault; each request it lets through unlimited is a fail_open line at
-- error level (above), which Debian's default error_log keeps.
function _M.default_on_error(what)
    if said_default[what] or not _M.loud() then
        return
    end
    said_default[what] = true
    ngx_log(WARN, "ratelimitd: ", what, " limiter has no on_error: when no decision can be had its requests pass",
        " (on_error = \"open\", the default; each is logged as fail_open). Set on_error = \"open\", \"closed\" or \"local\" to choose")
end

return _M

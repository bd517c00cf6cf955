-- resty.ratelimitd.config: the settings every limiter reads at each
-- request (configure{}), and their validation. The settings table is
-- changed in place, so modules may keep a reference to it.

local floor = math.floor
local type, error, tostring, pairs, ipairs = type, error, tostring, pairs, ipairs
local sub = string.sub

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

return _M

-- resty.ratelimitd.log: the client's failure lines, rate-limited per
-- worker and per kind, so an outage gives one line per interval for each of
-- fail_open, fail_closed, ... and a fail-open is never hidden behind a
-- fail-closed; and the lines said once per host when limiters are made.

local settings = require("resty.ratelimitd.config").settings

local ngx = ngx
local ngx_log, ngx_now, ERR, WARN = ngx.log, ngx.now, ngx.ERR, ngx.WARN

local _M = {}

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

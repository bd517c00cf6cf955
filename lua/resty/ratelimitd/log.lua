-- resty.ratelimitd.log: the client's failure lines, rate-limited per
-- worker and per kind, so an outage gives one line per interval for each of
-- fail_open, fail_closed, ... and a fail-open is never hidden behind a
-- fail-closed.

local settings = require("resty.ratelimitd.config").settings

local ngx = ngx
local ngx_log, ngx_now, ERR = ngx.log, ngx.now, ngx.ERR

local _M = {}

local last_log, suppressed = {}, {}

function _M.failure(what, key, reason)
    local now = ngx_now()
    if now - (last_log[what] or 0) < settings.log_interval then
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

return _M

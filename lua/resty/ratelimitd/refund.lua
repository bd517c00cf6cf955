-- resty.ratelimitd.refund: takes back what a refundable check recorded
-- (PROTOCOL.md 4c), from any phase: res.handle of a refundable limiter
-- (multi.lua) holds the daemon's handle and the check's items.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local log_failure = require("resty.ratelimitd.config").failure

local ngx = ngx
local type, error = type, error

local _M = {}

-- Sends a REFUND frame: true and the number of admission units taken back,
-- or nil and an error.
local function send_refund(handle)
    local id = conn.next_id()
    local res, err = conn.ask(nil, wire.refund(id, handle), id)
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

return _M

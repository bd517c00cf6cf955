-- resty.ratelimitd.settle: the actual cost of a reserved request
-- (PROTOCOL.md 4f), from any phase, usually log_by_lua once the upstream
-- has said what the request cost (tokens, bytes).
--
--   tokens = assert(ratelimitd.new{ policies = { "tokens_minute", "tokens_month" }, settle = true })
--   access_by_lua:  tokens:limit({ tenant, tenant }, estimate)  -- reserves the estimate in both, or neither
--   log_by_lua:     ratelimitd.settle(ngx.ctx.ratelimitd.handle, actual)
--
-- res.handle of a settle limiter (multi.lua) holds the item count, the
-- daemon's 16-byte handle and the reserve's items; the settle frame is
-- those items with each cost replaced by the actual. The estimates are kept
-- in Redis (or the memory backend), not here.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local log_failure = require("resty.ratelimitd.config").failure

local ngx = ngx
local type, error = type, error
local floor = math.floor

local _M = {}

-- The largest actual the daemon takes (wire.rs MAX_O1_COST).
_M.MAX_COST = 1000000000

local frame = wire.settle

-- For the unit tests (lua/spec/settle_spec.lua: the daemon's golden hex).
_M._frame = frame

-- Errors after which a settle is sent once more (PROTOCOL.md 4f): Redis
-- did not answer, or answered too late; the daemon keeps retrying it
-- too, and a settle applies at most once (its record is deleted with it),
-- so a second send after one that was applied but not answered changes
-- nothing.
local RETRYABLE = { REDIS_TIMEOUT = true, REDIS_UNAVAILABLE = true, REDIS_ERROR = true, CIRCUIT_OPEN = true, OVERLOADED = true }
_M.RETRY_DELAY = 0.05

-- Sends a SETTLE frame once: true and the response (count: the window's
-- count after the settle, 0 for a handle already settled), or nil, an
-- error, and whether sending again may help.
local function send_once(handle, actual)
    local id = conn.next_id()
    local res, err = conn.ask(nil, frame(id, handle, actual), id)
    if not res then
        return nil, err, true
    end
    if res.decision ~= "allowed" then
        return nil, res.error .. ": " .. res.message, RETRYABLE[res.error] or false
    end
    return true, res
end

-- Sends it, and once more after a transport error or a retryable code.
local function send_settle(handle, actual)
    local ok, res, again = send_once(handle, actual)
    if ok or not again then
        return ok, res
    end
    ngx.sleep(_M.RETRY_DELAY)
    return send_once(handle, actual)
end

-- For the unit tests (lua/spec/settle_spec.lua).
_M._send = send_settle

local function settle_timer(premature, handle, actual)
    if premature then
        return
    end
    local ok, err = send_settle(handle, actual)
    if not ok then
        log_failure("settle_failed", "-", err)
    end
end

-- Phases where cosockets are not available: the settle runs in a timer.
local NO_COSOCKET = { log = true, header_filter = true, body_filter = true, set = true, init_worker = true }

--- Settles a reserve (res.handle of a settle limiter) to `actual` units:
-- a surplus is given back, a shortfall charged (debt past the limit); sent
-- once more after a transport error or a retryable code (above). From
-- log_by_lua* it runs in a 0-delay timer and returns true at once;
-- elsewhere true and the daemon's answer, or nil and an error. A false/nil
-- handle (nothing was reserved: exempt, fail policy) is a no-op. An actual
-- that is no integer in 0..MAX_COST returns nil and an error (it comes from
-- the upstream); a handle that is no string raises (a bug in the caller).
function _M.settle(handle, actual)
    if not handle then
        return true
    end
    if type(handle) ~= "string" or #handle < 17 + 7 or handle:byte(1) < 1 or not frame(0, handle, 0) then
        error("settle: expects the handle of a settle limiter's reserve (res.handle)", 2)
    end
    if type(actual) ~= "number" or actual < 0 or actual > _M.MAX_COST or floor(actual) ~= actual then
        return nil, "settle: the actual cost must be an integer in 0.." .. _M.MAX_COST
    end
    if NO_COSOCKET[ngx.get_phase()] then
        local ok, err = ngx.timer.at(0, settle_timer, handle, actual)
        if not ok then
            return nil, "settle: timer: " .. err
        end
        return true
    end
    return send_settle(handle, actual)
end

return _M

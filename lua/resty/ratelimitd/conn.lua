-- resty.ratelimitd.conn: one request/response exchange with the daemon
-- over a pooled cosocket: connect (with a pause after connects that fail at
-- once), send, read the response, pool the connection only after a clean
-- exchange, and send once more when a pooled connection turns out closed.

local wire = require "resty.ratelimitd.wire"
local settings = require("resty.ratelimitd.config").settings

local ngx = ngx
local tcp = ngx.socket.tcp
local ngx_now = ngx.now
local sub = string.sub
local max, min = math.max, math.min
local tostring = tostring
local check_head, message_len, error_code, decode = wire.check_head, wire.message_len, wire.error_code, wire.decode
local RESPONSE_HEAD_LEN, RESPONSE_FIXED_LEN = wire.RESPONSE_HEAD_LEN, wire.RESPONSE_FIXED_LEN

local _M = {}

local request_id = 0

--- The id of the next request of this worker (1 to 2^32 - 1, wrapping).
function _M.next_id()
    request_id = request_id + 1
    if request_id > 4294967295 then
        request_id = 1
    end
    return request_id
end

-- Sends one frame and reads its response on a connected socket: the length
-- prefix and the fixed fields in one receive, the message (only with an
-- error code) in a second. Returns the 32 bytes of prefix and fixed fields,
-- the message and the extension (or nil), or nil and an error.
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
    local len
    len, err = check_head(head, id)
    if not len then
        return nil, err
    end
    local message, ext = "", nil
    if len > RESPONSE_FIXED_LEN then
        message, err = sock:receive(len - RESPONSE_FIXED_LEN)
        if not message then
            return nil, "receive: " .. err
        end
        local msg_len = message_len(head)
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
local connect_retry_at, connect_pause, connect_error = 0, 0, nil

--- Sends `frame` (request `id`) and reads its answer on a pooled
-- connection: the response's prefix and fixed fields (32 bytes), its
-- message and its extension (or nil); or nil and an error. A socket is
-- pooled only after a clean exchange, never after an error or a timeout.
function _M.transact(frame, id)
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
        sock:settimeouts(settings.connect_timeout, settings.send_timeout, settings.read_timeout)
        local ok
        ok, err = sock:connect(settings.socket)
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
    -- Codes 20-29: the stream cannot be trusted after them (PROTOCOL.md 9).
    local code = error_code(head)
    if code >= 20 and code < 30 then
        sock:close()
    else
        sock:setkeepalive(settings.keepalive_timeout, settings.pool_size)
    end
    return head, message, ext
end

local NO_LIMITER = {}

--- One request of limiter `lim` (nil: none): the decision table (with
-- lim's limit, local limit and policy name, wire.decode) and the
-- response's extension (or nil); or nil and an error.
function _M.ask(lim, frame, id)
    local head, message, ext = _M.transact(frame, id)
    if not head then
        return nil, message
    end
    lim = lim or NO_LIMITER
    return decode(head, message, lim._limit, lim._local_limit, lim._policy), ext
end

return _M

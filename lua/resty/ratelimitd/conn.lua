-- resty.ratelimitd.conn: one request/response exchange with the daemon
-- over a pooled cosocket: connect (tried again within the connect budget
-- during a daemon restart, paused after connects that keep failing at
-- once), send, read the response, pool the connection only after a clean
-- exchange, and send once more when the daemon closed it unanswered; and
-- the monotonic clock such an exchange is timed by.

local wire = require "resty.ratelimitd.wire"
local settings = require("resty.ratelimitd.config").settings

local ngx = ngx
local tcp = ngx.socket.tcp
local ngx_now, update_time, sleep, get_phase = ngx.now, ngx.update_time, ngx.sleep, ngx.get_phase
local sub = string.sub
local floor, max, min = math.floor, math.max, math.min
local tostring, pcall, require = tostring, pcall, require
local check_head, message_len, error_code, decode = wire.check_head, wire.message_len, wire.error_code, wire.decode
local RESPONSE_HEAD_LEN, RESPONSE_FIXED_LEN = wire.RESPONSE_HEAD_LEN, wire.RESPONSE_FIXED_LEN

local _M = {}

-- The clock a send is timed by (mono_us: the denial cache's entries are
-- anchored at it, a worker share's deadline counts from it):
-- CLOCK_MONOTONIC in µs, fresh at each call (a vDSO read, no syscall) and
-- the same for every worker of the host, unlike
-- ngx.now() (the wall clock, as cached at the start of the event loop
-- iteration: stale by up to that iteration's length, and stepped by NTP).
-- Read through the FFI into a buffer made once; the two 32-bit halves of
-- each field are read separately, so no 64-bit cdata is boxed per call.
-- Without the FFI, or on a big-endian or 32-bit ABI, mono_us is nil: the
-- denial cache and worker shares are off.
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
            local function mono_us()
                C.ratelimitd_clock_gettime(CLOCK_MONOTONIC, ts)
                local t = ts[0]
                return (t.sec_hi * 4294967296 + t.sec_lo) * 1000000 + floor(t.nsec_lo / 1000)
            end
            if pcall(mono_us) then
                _M.mono_us = mono_us
            end
        end
    end
end

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

-- A daemon restart is not a missing daemon. Without socket activation the
-- socket is absent (or refuses) for the few ms between the old daemon's
-- exit and the new one's bind; with it, connections queue instead. So a
-- connect that fails at once within RESTART_GRACE of this worker's last
-- successful connect is tried again for up to connect_timeout +
-- read_timeout (70 ms shipped: what the request may already spend on a
-- daemon that is slow, within the documented worst case of connect + send
-- + 2 x read): the new daemon answers it, where the pause above would have
-- given it (and every request of the worker for 50 ms or more) the fail
-- policy. The worker tries one connect at a time, 1, 2, 4, ... ms apart,
-- the other requests waiting for it: each failed connect is one of nginx's
-- own "connect() ... failed" lines, so a gap costs a worker about log2 of
-- its length in ms, whatever the load. A request that spends its whole
-- budget ends the grace: the daemon is gone, not restarting, and connects
-- pause as above.
local RESTART_GRACE = 1 -- s
local MAX_FRESH_CLOSED = 2
local PROBE_FIRST = 0.001 -- s
local MIN_SLEEP = 0.001 -- s: ngx.sleep's resolution
local last_connected = -RESTART_GRACE
-- When the worker's next connect during a restart may be tried, and the
-- wait after it.
local probe_at, probe_step = 0, PROBE_FIRST
-- Phases where the request may wait (ngx.sleep yields).
local MAY_SLEEP = { rewrite = true, access = true, content = true, timer = true }

-- Connects `sock`, trying again within the budget when a restart is likely
-- (above): true, or nil and the last error.
local function connect(sock)
    local ok, err = sock:connect(settings.socket)
    if ok or err == "timeout" or ngx_now() - last_connected >= RESTART_GRACE or not MAY_SLEEP[get_phase()] then
        return ok, err
    end
    update_time()
    local now = ngx_now()
    local deadline = now + (settings.connect_timeout + settings.read_timeout) / 1000
    if probe_at <= now then
        -- This failure was the worker's try.
        probe_at = now + probe_step
        probe_step = probe_step * 2
    end
    while true do
        if now >= deadline then
            -- Not back within a request's budget: gone, not restarting.
            last_connected = -RESTART_GRACE
            return nil, err
        end
        if now < probe_at then
            -- Never below 1 ms: ngx.sleep truncates to whole ms, and a
            -- sleep of 0 returns at once (a spin until the clock moves)
            -- and, without OpenResty's delayed-events patch, logs a warn
            -- line each time: thousands per restart (tests/nginx_restart_log.rs).
            sleep(max(min(probe_at - now, deadline - now), MIN_SLEEP))
        else
            probe_at = now + probe_step
            probe_step = probe_step * 2
            ok, err = sock:connect(settings.socket)
            if ok or err == "timeout" then
                return ok, err
            end
        end
        update_time()
        now = ngx_now()
    end
end

--- Sends `frame` (request `id`) and reads its answer on a pooled
-- connection: the response's prefix and fixed fields (32 bytes), its
-- message and its extension (or nil); or nil and an error. A socket is
-- pooled only after a clean exchange, never after an error or a timeout.
function _M.transact(frame, id)
    local sock, head, message, ext, err
    local fresh_closed = 0
    for attempt = 1, settings.pool_size + MAX_FRESH_CLOSED do
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
        ok, err = connect(sock)
        if not ok then
            err = "connect: " .. err
            -- During a likely restart each request tries on its own (above).
            if err ~= "connect: timeout" and ngx_now() - last_connected >= RESTART_GRACE then
                connect_pause = min(max(connect_pause * 2, CONNECT_RETRY_MIN), CONNECT_RETRY_MAX)
                connect_retry_at = ngx_now() + connect_pause
                connect_error = err
            end
            return nil, err
        end
        if connect_error then
            connect_error, connect_pause = nil, 0
        end
        last_connected = ngx_now()
        probe_at, probe_step = 0, PROBE_FIRST
        local reused = (sock:getreusedtimes() or 0) > 0
        head, message, ext = roundtrip(sock, frame, id)
        if head then
            break
        end
        err = message
        sock:close()
        -- A connection the daemon closed without answering fails at once:
        -- a pooled one it closed while it sat idle (after a restart, every
        -- pooled one: the next attempt takes the next from the pool), or a
        -- fresh one a stopping daemon accepted as it stopped. The daemon
        -- answers every request it has read before it closes (PROTOCOL.md
        -- section 8), so this one was never decided: it is sent again, on
        -- the next pooled connection or a fresh one, until MAX_FRESH_CLOSED
        -- fresh ones were closed too. Timeouts are not retried.
        if not CLOSED_BEFORE_READ[err] then
            return nil, err
        end
        if not reused then
            fresh_closed = fresh_closed + 1
            if fresh_closed == MAX_FRESH_CLOSED then
                return nil, err
            end
        end
        if attempt == settings.pool_size + MAX_FRESH_CLOSED then
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

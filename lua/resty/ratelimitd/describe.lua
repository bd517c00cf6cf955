-- resty.ratelimitd.describe: what the daemon's configuration says of a
-- policy name (DESCRIBE_POLICY, op 8, docs/PROTOCOL.md section 4g), and
-- how a limiter takes it:
--   * a policy limiter takes its window and local quota from the policy,
--     a multi-policy limiter each policy's own: window_ms and local_limit
--     need not be repeated in nginx (given, they win, for every policy of
--     the limiter, and a window that differs from a policy's is logged);
--   * header(): the frame header a policy limiter builds once, on the
--     request path; a limiter that must know its local quota before it can
--     send its first request (on_error = "local" without local_limit)
--     describes its policy itself if the worker-start verifier (verify.lua)
--     has not yet (one round trip, once).
-- Each description says how this worker's limiters use the policy (a
-- single check, an item of several, refundable, reserve and settle, worker
-- shares, a concurrency acquire): the daemon refuses a reload that would
-- make one of them impossible (docs/OPERATIONS.md).

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local config = require "resty.ratelimitd.config"

local bit = require "bit"

local ngx = ngx
local ngx_log, ERR, INFO = ngx.log, ngx.ERR, ngx.INFO
local bor = bit.bor
local USE = wire.USE
local ipairs, tostring = ipairs, tostring

local _M = {}

-- One line per host, not one per worker (config.lua).
local loud = config.loud

--- How `lim` uses its policies: a sum of wire.USE bits, as
-- DESCRIBE_POLICY's uses byte carries it.
function _M.uses(lim)
    if lim._kind_wanted == "concurrency" then
        return USE.acquire
    end
    if lim._names then
        if lim._flags == wire.FLAG_SETTLE then
            return USE.reserve
        end
        local several = #lim._names > 1 and USE.multi or 0
        if lim._flags == wire.FLAG_REFUNDABLE then
            return bor(USE.refundable, several)
        end
        return several ~= 0 and several or USE.single
    end
    return lim._share_dict and bor(USE.single, USE.share) or USE.single
end

-- A daemon of an earlier release answers a uses byte with
-- UNSUPPORTED_FLAGS: it is asked again without (once per worker).
local plain_only = false

--- The daemon's description of policy `name` (a table, wire.description),
-- false and the daemon's message for a name it does not have, or nil and
-- an error (daemon unreachable, a bad answer). `uses`: how this worker
-- uses it (wire.USE bits), recorded by the daemon.
function _M.describe(name, uses)
    local id = conn.next_id()
    local head, message = conn.transact(wire.describe(id, name, not plain_only and uses or nil), id)
    if not head then
        return nil, message
    end
    local d, err = wire.description(head, message)
    if d == nil and uses and not plain_only and tostring(err):find("^UNSUPPORTED_FLAGS") then
        plain_only = true
        return _M.describe(name)
    end
    return d, err
end

-- What a limiter calls itself in a log line.
local function label(lim)
    if lim._policy then
        return "policy \"" .. lim._policy .. "\""
    end
    return "policies \"" .. table.concat(lim._names or {}, ",") .. "\""
end

-- Says (once per host) when the daemon's policy is of the other kind than
-- the limiter naming it.
local function check_kind(lim, name, d)
    local wanted = lim._kind_wanted or "rate"
    if d.kind ~= wanted and loud() then
        ngx_log(ERR, "ratelimitd: policy \"", name, "\" is a ", d.kind, " policy in the daemon, used by a ",
            wanted, " limiter: its requests get WRONG_POLICY_KIND (",
            d.kind == "concurrency" and "use ratelimitd.concurrency{ policy = ... }" or "use ratelimitd.new{ policy = ... }", ")")
    end
end

-- Says once per host that nginx's window_ms differs from policy `name`'s.
local function window_mismatch(name, nginx_ms, policy_ms)
    if loud() then
        ngx_log(ERR, "ratelimitd: policy \"", name, "\": window_ms = ", nginx_ms,
            " in nginx differs from the policy's window of ", policy_ms,
            " ms in the daemon; nginx's is used for the client's own fallback only (drop window_ms to take the policy's)")
    end
end

--- Applies `d`, the description of its policy, to a limiter: a policy
-- limiter (lim._takes_description) takes the window and local quota of its
-- own fallback when nginx did not give them, and the policy's on_error
-- when the location set none. Returns true.
function _M.apply(lim, d)
    local name = lim._policy
    check_kind(lim, name, d)
    lim._described = true
    if not lim._takes_description then
        return true
    end
    if lim._window_given then
        if lim._window_ms ~= d.window_ms then
            window_mismatch(name, lim._window_ms, d.window_ms)
        end
    else
        lim._window_ms = d.window_ms
    end
    if lim._local_limit == nil then
        lim._local_limit = d.local_limit
    end
    if lim._on_error_defaulted then
        if d.on_error then
            lim._on_error = d.on_error
        else
            config.default_on_error("policy \"" .. name .. "\"")
        end
    end
    if lim._on_described then
        lim:_on_described()
    end
    -- Per worker, at info level (not kept by Debian's default error_log):
    -- what this worker's fallback for the policy now counts with.
    ngx_log(INFO, "ratelimitd: policy \"", name, "\" described by the daemon: ", d.kind, " ", d.algorithm,
        " limit=", d.limit, " window_ms=", d.window_ms, " on_error=", d.on_error or "-",
        " local_limit=", d.local_limit or "-", "; this limiter's fallback: on_error=", lim._on_error,
        " window_ms=", lim._window_ms, " local_limit=", lim._local_limit or "-")
    return true
end

--- Applies `ds`, the descriptions of its policies in order, to a
-- multi-policy limiter: each policy's own fallback window and local quota
-- (lim._windows[i], lim._local_limits[i]) unless nginx gave them (then the
-- same for every policy), and the frame's local quota (lim:_on_described).
-- Returns true.
function _M.apply_many(lim, ds)
    local windows, quotas, shown = {}, {}, {}
    for i, d in ipairs(ds) do
        local name = lim._names[i]
        check_kind(lim, name, d)
        if lim._window_given then
            if lim._window_ms ~= d.window_ms then
                window_mismatch(name, lim._window_ms, d.window_ms)
            end
            windows[i] = lim._window_ms
        else
            windows[i] = d.window_ms
        end
        -- nil: the policy has no local quota (wire.lua reads 0 as none).
        quotas[i] = lim._local_limit or d.local_limit
        shown[i] = quotas[i] or "-"
    end
    lim._windows, lim._local_limits = windows, quotas
    lim._described = true
    if lim._on_described then
        lim:_on_described()
    end
    -- Per worker, at info level, as apply's line.
    ngx_log(INFO, "ratelimitd: policies \"", table.concat(lim._names, ","), "\" described by the daemon; this limiter's fallback: on_error=",
        lim._on_error, " window_ms=", table.concat(windows, ","), " local_limit=", table.concat(shown, ","))
    return true
end

--- Describes lim's policy now (a request of a limiter the timer has not
-- reached): true, or nil and an error.
function _M.now(lim)
    if lim._names then
        local ds = {}
        local uses = _M.uses(lim)
        for i, name in ipairs(lim._names) do
            local d, err = _M.describe(name, uses)
            if not d then
                if d == false then
                    lim._described, lim._unknown = true, true
                    return nil, "UNKNOWN_POLICY: policy \"" .. name .. "\": " .. tostring(err)
                end
                return nil, err
            end
            ds[i] = d
        end
        lim._unknown = nil
        return _M.apply_many(lim, ds)
    end
    local d, err = _M.describe(lim._policy, _M.uses(lim))
    if d then
        lim._unknown = nil
        return _M.apply(lim, d)
    end
    if d == false then
        lim._described, lim._unknown = true, true
        return nil, "UNKNOWN_POLICY: policy \"" .. lim._policy .. "\": " .. tostring(err)
    end
    return nil, err
end

--- The frame header of a policy limiter: lim._header once built, else build(lim), which is nil while
-- on_error is "local" and the local quota, to come from the daemon, is not
-- known; then described now, once (an unknown name asked
-- again: a reload may add it, as a CHECK_POLICY would be). The header, or
-- nil and why not.
function _M.header(lim, build)
    local h = lim._header or build(lim)
    if h then
        return h
    end
    local ok, err = lim._described and not lim._unknown, nil
    if not ok then
        ok, err = _M.now(lim)
    end
    h = ok and build(lim)
    if h then
        return h
    end
    local which = lim._names and ("a policy of \"" .. table.concat(lim._names, ",") .. "\"") or ("policy \"" .. lim._policy .. "\"")
    if lim._unknown then
        return nil, err or ("UNKNOWN_POLICY: " .. which .. " is not in the daemon's configuration")
    end
    return nil, err or (which .. " has no local_limit in the daemon: on_error = \"local\" needs local_limit here or in ratelimitd.toml")
end

_M.label = label

return _M

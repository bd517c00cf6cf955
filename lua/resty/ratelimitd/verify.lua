-- resty.ratelimitd.verify: what the daemon's configuration says of a
-- policy name (DESCRIBE_POLICY, op 8, docs/PROTOCOL.md section 4g), how a
-- limiter takes it, and the worker-start verifier that asks for it.
--   * a policy limiter takes its window and local quota from the policy,
--     a multi-policy limiter each policy's own: window_ms and local_limit
--     need not be repeated in nginx (given, they win, for every policy of
--     the limiter, and a window that differs from a policy's is logged);
--   * every limiter that names policies registers here when it is made;
--     schedule() (called by limiters.build, or by verify_policies() from
--     init_worker_by_lua) describes them in a timer right after the worker
--     starts, and again with a back-off while the daemon cannot be
--     reached, so that a name the daemon lacks (a typo, a rename) is said
--     loudly in error.log when the worker starts, not found by the first
--     503;
--   * now(): a limiter that must know its local quota before it can send
--     its first request (on_error = "local" without local_limit) describes
--     its policy itself if the verifier has not yet (one round trip, once;
--     kind.header, on the request path, calls it).
-- Nothing else here runs on the request path: the frame header a policy
-- limiter builds once is kind.lua's (header()).
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
local min = math.min
local bor = bit.bor
local USE = wire.USE
local pairs, ipairs, setmetatable, tostring, type = pairs, ipairs, setmetatable, tostring, type

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

_M.label = label

-- Every limiter naming policies in this worker, with the name it was built
-- under (weak keys: a limiter dropped is not verified).
local registered = setmetatable({}, { __mode = "k" })

local RETRY_MIN, RETRY_MAX = 1, 30 -- s between two attempts while the daemon is unreachable

--- Registers `lim` (fields _policy, or _names for several) for verification.
function _M.register(lim)
    registered[lim] = true
end

local running = false

-- Describes every registered limiter not yet described; true when none is
-- left (or nil and the error that stopped it: the daemon is unreachable).
local function verify_all()
    -- Every use of each name by the limiters left, in one description.
    local uses = {}
    for lim in pairs(registered) do
        if not lim._described then
            local u = _M.uses(lim)
            for _, name in ipairs(lim._names or { lim._policy }) do
                uses[name] = bor(uses[name] or 0, u)
            end
        end
    end
    local seen = {}
    for lim in pairs(registered) do
        if not lim._described then
            local names = lim._names or { lim._policy }
            local all_known = true
            local ds = {}
            for _, name in ipairs(names) do
                local d = seen[name]
                if d == nil then
                    local err
                    d, err = _M.describe(name, uses[name])
                    if d == nil then
                        return nil, err
                    end
                    seen[name] = d
                    if d == false and loud() then
                        -- One line per unknown name.
                        ngx_log(ERR, "ratelimitd: policy \"", name, "\" is not in the daemon's configuration (",
                            tostring(err), "): every request of its limiter gets the location's on_error until the daemon has it",
                            " (ratelimitd check-config --nginx says which names nginx uses)")
                    end
                end
                if d == false then
                    all_known = false
                elseif not lim._names then
                    _M.apply(lim, d)
                else
                    ds[#ds + 1] = d
                end
            end
            if lim._names and all_known then
                _M.apply_many(lim, ds)
            end
            lim._described = true
            if not all_known then
                lim._unknown = true
            end
        end
    end
    return true
end

local function timer(premature, delay)
    if premature then
        running = false
        return
    end
    local ok, err = verify_all()
    if ok then
        running = false
        return
    end
    if loud() and delay == RETRY_MIN then
        ngx_log(ERR, "ratelimitd: cannot verify the policy names of this worker's limiters yet (", tostring(err),
            "): retrying every ", RETRY_MIN, " to ", RETRY_MAX, " s")
    end
    local next_delay = min(delay * 2, RETRY_MAX)
    local ok2, terr = ngx.timer.at(delay, timer, next_delay)
    if not ok2 then
        running = false
        ngx_log(ERR, "ratelimitd: cannot schedule the policy verification: ", tostring(terr))
    end
end

--- Describes the registered limiters in a timer (from init_worker_by_lua,
-- or later): true, or nil and why not (in init_by_lua there are no timers:
-- the workers' init_worker must call it).
function _M.schedule()
    if running then
        return true
    end
    if type(ngx.get_phase) == "function" and ngx.get_phase() == "init" then
        return nil, "no timers in init_by_lua: call require(\"resty.ratelimitd\").verify_policies() from init_worker_by_lua"
    end
    local ok, err = ngx.timer.at(0, timer, RETRY_MIN)
    if not ok then
        return nil, err
    end
    running = true
    return true
end

return _M

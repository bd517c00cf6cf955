-- resty.ratelimitd.fallback: what the location's fail policy (on_error)
-- decides when the daemon gives no decision: open, closed, or a local
-- quota per host, an approximate sliding window in the shared dict (the
-- previous fixed window weighted by its overlap, plus the current one).

local config = require "resty.ratelimitd.config"

local ngx = ngx
local ngx_now = ngx.now
local ngx_shared = ngx.shared
local floor, ceil, max = math.floor, math.ceil, math.max
local format, concat = string.format, table.concat
local settings, log_failure = config.settings, config.failure

local _M = {}

local function counter_key(key, window, start)
    return format("%s|%d|%d", key, window, start)
end

-- The local quota's decision for `key` (a wire key) of `cost`, or nil and
-- an error. `limit` per `window` ms, shared by the host's workers.
local function local_decision(key, cost, limit, window)
    local dict = ngx_shared[settings.shared_dict]
    if not dict then
        return nil, "lua_shared_dict '" .. settings.shared_dict .. "' is not defined"
    end
    local now = ngx_now() * 1000
    local start = floor(now / window) * window
    local cur_key = counter_key(key, window, start)
    local prev = dict:get(counter_key(key, window, start - window)) or 0
    local weighted = floor(prev * (window - (now - start)) / window)
    local reset_ms = ceil(start + window - now)
    -- Take the cost first and give it back if it does not fit: the shared
    -- dict's incr is atomic across workers, a read-then-write would not be.
    local cur, err, forcible = dict:incr(cur_key, cost, 0, 2 * window / 1000)
    if not cur then
        return nil, "shared dict: " .. err
    end
    if forcible then
        log_failure("shared_dict_full", key, "lua_shared_dict '" .. settings.shared_dict .. "' evicted entries: enlarge it")
    end
    if weighted + cur > limit then
        dict:incr(cur_key, -cost)
        local count = weighted + cur - cost
        return { allowed = false, decision = "denied", source = "lua_local", count = count,
                 remaining = max(limit - count, 0), retry_after_ms = reset_ms, reset_ms = reset_ms, limit = limit }
    end
    return { allowed = true, decision = "allowed", source = "lua_local", count = weighted + cur,
             remaining = limit - weighted - cur, retry_after_ms = 0, reset_ms = reset_ms, limit = limit }
end

local NO_LOCAL_WINDOW = "; local fallback: the policy's window and local_limit are not known yet (the daemon has not"
    .. " described it since this worker started; give window_ms and local_limit in nginx to count locally from the start)"

local NO_LOCAL_QUOTA = "; local fallback: the policy has no local_limit in the daemon and the limiter none in nginx"
    .. " (on_error = \"local\" needs one of them)"

--- The policy named in lim's failure lines: its policy, or policies (nil
-- for an inline limiter).
local function policy_of(lim)
    return lim._policy_label or lim._policy
end
_M.policy_of = policy_of

--- The location's policy for one key (`lim`: _on_error, _limit,
-- _local_limit, _window_ms), logged with `reason`.
function _M.one(lim, key, cost, reason)
    local on_error = lim._on_error
    local policy = policy_of(lim)
    if on_error == "local" and not (lim._local_limit and lim._window_ms) then
        -- A policy limiter whose quota and window come from the daemon,
        -- which has not described its policy yet (unreachable since the
        -- worker started): no local window to count in. Open, and said so.
        log_failure("fail_open", key, reason .. (lim._described and NO_LOCAL_QUOTA or NO_LOCAL_WINDOW), policy)
        return { allowed = true, decision = "allowed", source = "lua_fail_open", limit = lim._limit }
    end
    if on_error == "open" then
        log_failure("fail_open", key, reason, policy)
        return { allowed = true, decision = "allowed", source = "lua_fail_open", limit = lim._limit }
    end
    if on_error == "local" then
        local res, err = local_decision(key, cost, lim._local_limit, lim._window_ms)
        if res then
            log_failure("local_fallback", key, reason, policy)
            return res
        end
        reason = reason .. "; local fallback: " .. err
    end
    log_failure("fail_closed", key, reason, policy)
    return { allowed = false, decision = "denied", source = "lua_fail_closed", limit = lim._limit,
             retry_after_ms = 1000 }
end

--- The location's policy for a multi-item request, all or nothing: "local"
-- checks each key (scoped by its policy's name) in the per-host quota of
-- its policy, over its policy's window (lim._local_limits, lim._windows,
-- from the daemon's description; else nginx's local_limit and window_ms),
-- and gives back what it took when one refuses (approximate, like one
-- key's). A policy whose window or quota is not known: open, said so (one).
function _M.many(lim, keys, costs, reason)
    local label = concat(keys, ",")
    if lim._on_error ~= "local" then
        return _M.one(lim, label, 1, reason)
    end
    local names, windows, quotas = lim._names, lim._windows, lim._local_limits
    for i = 1, lim._n do
        if not ((quotas and quotas[i] or lim._local_limit) and (windows and windows[i] or lim._window_ms)) then
            -- one() finds no quota or window either: open, with why.
            return _M.one(lim, label, 1, reason)
        end
    end
    -- The admission shows the numbers of its most constrained item, as
    -- the daemon's main item (wire.main_item) would.
    local taken, main = {}, nil
    for i = 1, lim._n do
        local key = names[i] .. "|" .. keys[i]
        local window = windows and windows[i] or lim._window_ms
        local res, err = local_decision(key, costs[i], quotas and quotas[i] or lim._local_limit, window)
        if not res or not res.allowed then
            local dict = ngx_shared[settings.shared_dict]
            local now = ngx_now() * 1000
            for j = 1, #taken do
                local t = taken[j]
                dict:incr(counter_key(t[1], t[3], floor(now / t[3]) * t[3]), -t[2])
            end
            if not res then
                return _M.one(lim, label, 1, reason .. "; local fallback: " .. err)
            end
            log_failure("local_fallback", label, reason, policy_of(lim))
            res.policy = names[i]
            return res
        end
        taken[#taken + 1] = { key, costs[i], window }
        if not main or res.remaining < main.remaining then
            main = res
            main.policy = names[i]
        end
    end
    log_failure("local_fallback", label, reason, policy_of(lim))
    return main
end

return _M

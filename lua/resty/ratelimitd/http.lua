-- resty.ratelimitd.http: the HTTP side of a decision, for every limiter
-- kind, the answer given to nginx: the fail policy when the daemon gave
-- none, the status of a refusal,
-- the quota headers per style, GCRA pacing, Retry-After, the problem body,
-- $ratelimitd_status and ngx.ctx.ratelimitd. The only module that ends a
-- request (ngx.exit); the limiters below it return nil, err.
--
-- The quota fields of a decision in each header style are written into a
-- header table (ngx.header in nginx, a plain table in the unit tests). Only
-- what counted and binds the client shows: after a fail-open or
-- fail-closed nothing was counted, so no quota is promised; an exempt key
-- has none; a shadow policy refuses nothing, so it never shows
-- (SEMANTICS S3).
--
-- The location's fail policy (on_error) decides when the daemon gives no
-- decision: open, closed, or a local quota per host, an approximate
-- sliding window in the shared dict (the previous fixed window weighted by
-- its overlap, plus the current one): fallback() for one key, fallback_many()
-- for a multi-item request.
--
-- A limiter kind gives enforce():
--   lim:_decide(key, cost, lease_id) the decision table, or nil and an error
--   lim:_fallback(key, cost, reason) the location's policy's decision
--   lim:_label(key)                 the key(s) as logged
-- and the fields _policy, _limit, _window_ms, _shadow (a set of names),
-- _set_ctx; `beh` holds status, fail_closed_status, invalid_status,
-- headers, header_style, dry_run, nodelay, delay: the limiter itself, or
-- the table form's own options table.

local config = require "resty.ratelimitd.config"
local wire = require "resty.ratelimitd.wire"
local request = require "resty.ratelimitd.request"

local ngx = ngx
local ngx_log, INFO = ngx.log, ngx.INFO
local ngx_exit, ngx_sleep, ngx_header = ngx.exit, ngx.sleep, ngx.header
local ngx_now, ngx_shared = ngx.now, ngx.shared
local floor, ceil, max = math.floor, math.ceil, math.max
local format, concat = string.format, table.concat
local ipairs = ipairs
local UNKNOWN_POLICY, main_item = wire.UNKNOWN_POLICY, wire.main_item
local settings, log_failure = config.settings, config.failure

local _M = {}

-- The location's fail policy: fallback(), fallback_many().

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
function _M.fallback(lim, key, cost, reason)
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
-- key's). A policy whose window or quota is not known: open, said so
-- (fallback).
function _M.fallback_many(lim, keys, costs, reason)
    local label = concat(keys, ",")
    if lim._on_error ~= "local" then
        return _M.fallback(lim, label, 1, reason)
    end
    local names, windows, quotas = lim._names, lim._windows, lim._local_limits
    for i = 1, lim._n do
        if not ((quotas and quotas[i] or lim._local_limit) and (windows and windows[i] or lim._window_ms)) then
            -- fallback() finds no quota or window either: open, with why.
            return _M.fallback(lim, label, 1, reason)
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
                return _M.fallback(lim, label, 1, reason .. "; local fallback: " .. err)
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

-- The quota headers and the problem body: set_headers(), problem_body().

-- Sources whose numbers come from a real count.
local COUNTED = { redis = true, memory = true, ["local"] = true, lua_local = true, denial_cache = true, lua_denial_cache = true }
_M.COUNTED = COUNTED

-- Decisions of a shadow policy, marked by the daemon whether it refused or
-- had room: never shown, whatever the limiter declares.
local SHADOW = { shadow_denied = true, shadow_allowed = true }
_M.SHADOW = SHADOW

-- An item (or a one-item decision) that is shown: counted, with a limit,
-- and not a shadow policy's (marked by the daemon, or named in `hidden`:
-- the `shadow` option, for a daemon that does not mark shadow_allowed).
local function shown(it, hidden)
    return COUNTED[it.source] and it.limit and it.limit > 0 and not SHADOW[it.decision]
        and not (hidden and hidden[it.policy])
end

-- The RateLimit-Policy and RateLimit fields of the current draft
-- (draft-ietf-httpapi-ratelimit-headers-12): one list member per policy
-- shown, named by the policy; w only for a whole number of seconds; t of a
-- refusing policy is its retry-after, the value of Retry-After.
local function draft(out, res, hidden)
    local items = res.items
    if not items then
        items = { { policy = res.policy or "default", source = res.source, decision = res.decision, limit = res.limit,
                    window_ms = res.window_ms, remaining = res.remaining, retry_after_ms = res.retry_after_ms, reset_ms = res.reset_ms } }
    end
    local policies, states = {}, {}
    for _, it in ipairs(items) do
        if shown(it, hidden) then
            local w = it.window_ms
            local name = format("%q", it.policy)
            if w and w % 1000 == 0 then
                policies[#policies + 1] = format("%s;q=%d;w=%d", name, it.limit, w / 1000)
            else
                policies[#policies + 1] = format("%s;q=%d", name, it.limit)
            end
            local t = it.decision == "denied" and it.retry_after_ms or it.reset_ms or 0
            states[#states + 1] = format("%s;r=%d;t=%d", name, it.remaining or 0, ceil(t / 1000))
        end
    end
    if #policies > 0 then
        out["RateLimit-Policy"] = concat(policies, ", ")
        out["RateLimit"] = concat(states, ", ")
    end
end

local LEGACY = {
    ratelimit = { "RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset" },
    x = { "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset" },
}

--- Writes the quota fields of `res` in `style` ("ratelimit", "draft" or
-- "x") into `out`. `hidden`: a set of policy names in shadow mode, or nil
-- (needed only with a daemon that does not mark shadow_allowed).
-- The legacy styles show one policy: the refusing one, else the most
-- constrained one shown.
function _M.set_headers(out, res, style, hidden)
    if style == "draft" then
        return draft(out, res, hidden)
    end
    local it = res
    if res.items then
        it = main_item(res.items, hidden)
        if not it then
            return
        end
    elseif SHADOW[res.decision] or res.policy and hidden and hidden[res.policy] then
        return
    end
    if not shown(it, nil) then
        return
    end
    local names = LEGACY[style]
    out[names[1]] = it.limit
    out[names[2]] = it.remaining
    out[names[3]] = ceil((it.reset_ms or 0) / 1000)
end

-- The problem type of a refusal in the draft, with the violated policies.
local PROBLEM_TYPE = "https://iana.org/assignments/http-problem-types#quota-exceeded"

--- The application/problem+json body of a refusal with `status`: the
-- draft's quota-exceeded type, naming every policy that refused.
function _M.problem_body(res, status)
    local violated = {}
    if res.items then
        for _, it in ipairs(res.items) do
            if it.decision == "denied" and it.source ~= "none" then
                violated[#violated + 1] = format("%q", it.policy)
            end
        end
    else
        violated[1] = format("%q", res.policy or "default")
    end
    return format('{"type":"%s","title":"Request cannot be satisfied as assigned quota has been exceeded","status":%d,"violated-policies":[%s]}\n',
                  PROBLEM_TYPE, status, concat(violated, ","))
end

-- The decision given to nginx: enforce().

-- Sources after which Redis failed behind the daemon, which applied the
-- location's policy.
local DAEMON_FAIL = { fail_open = "daemon_fail_open", fail_closed = "daemon_fail_closed", ["local"] = "daemon_local" }
local FAIL_OPEN = { fail_open = true, lua_fail_open = true }
local FAIL_CLOSED = { fail_closed = true, lua_fail_closed = true }

-- The outcome for access logs and later phases: ngx.ctx.ratelimitd (the
-- decision table) from multi-policy and refundable limiters, or from every
-- limiter with configure{ set_ctx = true } (ngx.ctx makes a table per
-- request: not done unless asked); with configure{ log_var = "name" },
-- $name set to PASSED, DELAYED, REJECTED, REJECTED_DRY_RUN, PASSED_SHADOW,
-- FAIL_OPEN or ERROR (like $limit_req_status).
local function log_outcome(lim, res, outcome)
    if lim._set_ctx or settings.set_ctx then
        ngx.ctx.ratelimitd = res
        -- For refund() and settle() after an internal redirect.
        request.keep(res)
    end
    local var = settings.log_var
    if var ~= "" then
        ngx.var[var] = outcome
    end
end

-- A shadow policy's refusal among a multi-item decision's items: reported
-- as PASSED_SHADOW, never enforced.
local function shadow_item_refused(items)
    for i = 1, #items do
        if items[i].decision == "shadow_denied" then
            return true
        end
    end
    return false
end

-- GCRA pacing (docs/ALGORITHMS.md): the daemon admits a request ahead of
-- its place at the rate with retry_after_ms its delay; only GCRA admits
-- with a delay, so no algorithm need be known (a named policy's is the
-- daemon's). Paced unless nodelay; the first `delay` of a burst at once:
-- one emission interval T each, the limiter's window / limit, or for a
-- policy what the response carries (reset_ms - retry_after_ms is the cost's
-- T, to the ms). Called for an admitted request with a delay (`wait` ms);
-- returns true when it slept.
local function pace(lim, beh, res, cost, wait)
    if beh.nodelay or beh.dry_run then
        return false
    end
    local delay = beh.delay
    if delay and delay > 0 then
        local t
        if lim._limit and lim._window_ms then
            t = lim._window_ms / lim._limit
        else
            t = (res.reset_ms - res.retry_after_ms) / cost
        end
        wait = wait - delay * t
    end
    if wait <= 0 then
        return false
    end
    ngx_sleep(wait / 1000)
    return true
end

-- The decision of `lim` for `key` of `cost`: the daemon's, else the
-- location's fail policy's. A decision "error" left in it is the daemon
-- refusing the request as invalid (codes 1-29).
local function decide(lim, key, cost, lease_id)
    local res, err = lim:_decide(key, cost, lease_id)
    if not res then
        return lim:_fallback(key, cost, err)
    elseif res.error_code == UNKNOWN_POLICY then
        -- The daemon's configuration has no policy of this name (a typo, or
        -- a reload that removed it): a configuration error, logged as such
        -- at error level; until it is fixed the location's on_error decides.
        log_failure("unknown_policy", lim:_label(key), res.message, policy_of(lim))
        return lim:_fallback(key, cost, "UNKNOWN_POLICY")
    elseif res.decision == "error" and res.error_code < 30 then
        log_failure("invalid_request", lim:_label(key), res.error .. ": " .. res.message, policy_of(lim))
    elseif res.decision == "error" then
        -- No decision for a reason of the daemon's own (its in-memory
        -- windows are full: LOCAL_CAPACITY): decided by the policy.
        return lim:_fallback(key, cost, res.error .. ": " .. res.message)
    elseif DAEMON_FAIL[res.source] then
        log_failure(DAEMON_FAIL[res.source], lim:_label(key), res.error .. ": " .. res.message, policy_of(lim))
    end
    return res
end

--- For access_by_lua*: decides `key` (the wire key(s), from the caller's
-- argument checks) of `cost` with `lim`; lets the request through (the
-- decision table is returned) or ends it with its status.
-- The same limiter deciding the same key and cost again in the same request
-- (a server-level access_by_lua* run again after an internal redirect)
-- reuses the first decision (request.lua): one count per request. Not for
-- concurrency leases (`lease_id`), which concurrency.lua keeps itself.
function _M.enforce(lim, beh, key, cost, lease_id)
    local res, memo, call, again
    if lease_id == nil then
        res, memo, call = request.decided(lim, key, cost)
    end
    if res then
        again = true
    else
        res = decide(lim, key, cost, lease_id)
        if memo then
            request.remember(memo, lim, call, res)
        end
    end
    if res.decision == "error" then
        -- The daemon refused the request as invalid (codes 1-29: a limit,
        -- window or cost outside its bounds, a combination it cannot
        -- honour): this location is misconfigured. That is not an outage,
        -- so on_error does not decide (with "open" it would pass every
        -- request unlimited): the request gets its own status, 500 by
        -- default, and the error is logged as such (decide()).
        log_outcome(lim, res, "ERROR")
        if beh.dry_run then
            return res
        end
        return ngx_exit(beh.invalid_status or settings.invalid_status)
    end
    -- A policy's window is the daemon's (in the items of a multi-item
    -- answer); window_ms of a policy limiter is its own fallback's, for its
    -- own fallback only.
    if not lim._policy or res.source == "lua_local" then
        res.window_ms = lim._window_ms
    end
    local show = beh.headers
    if show == nil then
        show = settings.headers
    end
    local items = res.items
    if not items and (res.decision == "shadow_denied" or res.decision == "shadow_allowed") then
        -- A one-policy limiter of a shadow policy: nothing the client
        -- should see, no headers, no refusal. PASSED_SHADOW only when the
        -- policy would have refused.
        if res.decision == "shadow_denied" then
            ngx_log(INFO, "ratelimitd: shadow_denied policy=", lim._policy, " key=", key, " source=", res.source)
            log_outcome(lim, res, "PASSED_SHADOW")
        else
            log_outcome(lim, res, FAIL_OPEN[res.source] and "FAIL_OPEN" or "PASSED")
        end
        return res
    end
    if show then
        _M.set_headers(ngx_header, res, beh.header_style or settings.header_style, lim._shadow)
    end
    if res.allowed then
        local outcome = "PASSED"
        -- Only an admission with a delay (GCRA's) has a retry-after.
        local wait = res.retry_after_ms
        if FAIL_OPEN[res.source] then
            outcome = "FAIL_OPEN"
        elseif wait and wait > 0 and res.decision == "allowed" and not again and pace(lim, beh, res, cost, wait) then
            -- DELAYED as limit_req's $limit_req_status says of a paced request.
            outcome = "DELAYED"
        elseif res.decision == "shadow_denied" or items and shadow_item_refused(items) then
            outcome = "PASSED_SHADOW"
        end
        log_outcome(lim, res, outcome)
        return res
    end
    if beh.dry_run then
        ngx_log(INFO, "ratelimitd: dry_run would deny policy=", policy_of(lim) or "-", " key=", lim:_label(key), " source=", res.source)
        log_outcome(lim, res, "REJECTED_DRY_RUN")
        return res
    end
    log_outcome(lim, res, "REJECTED")
    local closed = FAIL_CLOSED[res.source]
    if show or closed then
        ngx_header["Retry-After"] = max(1, ceil((res.retry_after_ms or 1000) / 1000))
    end
    if closed then
        return ngx_exit(beh.fail_closed_status or settings.fail_closed_status)
    end
    local status = beh.status or settings.status
    if settings.problem_body then
        ngx.status = status
        ngx_header["Content-Type"] = "application/problem+json"
        ngx.print(_M.problem_body(res, status))
    end
    return ngx_exit(status)
end

return _M

-- resty.ratelimitd.http: the HTTP side of a decision, for every limiter
-- kind: the fail policy when the daemon gave none, the status of a refusal,
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
local policy_of = require("resty.ratelimitd.fallback").policy_of
local request = require "resty.ratelimitd.request"

local ngx = ngx
local ngx_log, INFO = ngx.log, ngx.INFO
local ngx_exit, ngx_sleep, ngx_header = ngx.exit, ngx.sleep, ngx.header
local ceil, max = math.ceil, math.max
local format, concat = string.format, table.concat
local ipairs = ipairs
local UNKNOWN_POLICY, main_item = wire.UNKNOWN_POLICY, wire.main_item
local settings, log_failure = config.settings, config.failure

local _M = {}

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

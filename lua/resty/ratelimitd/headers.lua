-- resty.ratelimitd.headers: the quota fields of a decision in each header
-- style, written into a header table (ngx.header in nginx, a plain table in
-- the unit tests). Only what counted and binds the client shows: after a
-- fail-open or fail-closed nothing was counted, so no quota is promised;
-- an exempt key has none; a shadow policy refuses nothing, so it never
-- shows (SEMANTICS S3).

local wire = require "resty.ratelimitd.wire"

local ceil = math.ceil
local format, concat = string.format, table.concat
local ipairs = ipairs
local main_item = wire.main_item

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
function _M.set(out, res, style, hidden)
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

return _M

-- The quota headers per style (resty/ratelimitd/http.lua), with shadow policies (SEMANTICS S3: never
-- shown), exempt items and undecided requests.

-- http.lua (and the modules it requires) read ngx when loaded, and
-- request.lua resty.core's request getter: stand-ins, as request_spec.lua
-- makes them (no nginx here).
rawset(_G, "ngx", rawget(_G, "ngx") or {})
package.loaded["resty.core.base"] = package.loaded["resty.core.base"] or { get_request = function() return nil end }

local http = require "resty.ratelimitd.http"

local function item(policy, decision, limit, remaining, extra)
    local it = { policy = policy, decision = decision, source = "redis", count = limit - remaining, remaining = remaining,
                 retry_after_ms = decision == "denied" and 2500 or 0, reset_ms = 60000, limit = limit, window_ms = 60000 }
    for k, v in pairs(extra or {}) do
        it[k] = v
    end
    return it
end

local function render(res, style, hidden)
    local out = {}
    http.set_headers(out, res, style, hidden)
    return out
end

describe("headers", function()
    local one = { decision = "allowed", source = "redis", limit = 5, remaining = 4, reset_ms = 9500, retry_after_ms = 0, window_ms = 10000 }

    it("renders one limit in each style", function()
        assert.same({ ["RateLimit-Limit"] = 5, ["RateLimit-Remaining"] = 4, ["RateLimit-Reset"] = 10 }, render(one, "ratelimit"))
        assert.same({ ["X-RateLimit-Limit"] = 5, ["X-RateLimit-Remaining"] = 4, ["X-RateLimit-Reset"] = 10 }, render(one, "x"))
        assert.same({ ["RateLimit-Policy"] = '"default";q=5;w=10', ["RateLimit"] = '"default";r=4;t=10' }, render(one, "draft"))
    end)

    it("leaves w out for a partial second and gives a refusal's t as its retry-after", function()
        local res = { decision = "denied", source = "redis", limit = 3, remaining = 0, reset_ms = 1400, retry_after_ms = 1100, window_ms = 1500, policy = "p" }
        assert.same({ ["RateLimit-Policy"] = '"p";q=3', ["RateLimit"] = '"p";r=0;t=2' }, render(res, "draft"))
    end)

    it("promises no quota when nothing was counted or the key is exempt", function()
        for _, source in ipairs({ "lua_fail_open", "fail_open", "fail_closed", "lua_fail_closed", "exempt" }) do
            local res = { decision = "allowed", source = source, limit = 5, remaining = 5, reset_ms = 0 }
            assert.same({}, render(res, "ratelimit"))
            assert.same({}, render(res, "draft"))
        end
    end)

    local function multi(shadow_decision, shadow_remaining)
        return { decision = "allowed", source = "redis", items = {
            item("per_ip", "allowed", 10, 9),
            item("next", shadow_decision, 1, shadow_remaining),
            item("per_tenant", "allowed", 5, 4),
            item("vip", "allowed", 0, 0, { source = "exempt" }),
        } }
    end

    it("never lists a shadow policy's refusal", function()
        local out = render(multi("shadow_denied", 0), "draft")
        assert.equals('"per_ip";q=10;w=60, "per_tenant";q=5;w=60', out["RateLimit-Policy"])
        assert.equals('"per_ip";r=9;t=60, "per_tenant";r=4;t=60', out["RateLimit"])
        assert.same({ ["RateLimit-Limit"] = 5, ["RateLimit-Remaining"] = 4, ["RateLimit-Reset"] = 60 }, render(multi("shadow_denied", 0), "ratelimit"))
    end)

    it("never shows a declared shadow policy, even when it had room", function()
        local hidden = { next = true }
        local out = render(multi("allowed", 0), "draft", hidden)
        assert.equals('"per_ip";q=10;w=60, "per_tenant";q=5;w=60', out["RateLimit-Policy"])
        -- Undeclared, the one with room looks like any other policy: the
        -- most constrained (remaining 0) would be shown.
        assert.same({ ["RateLimit-Limit"] = 1, ["RateLimit-Remaining"] = 0, ["RateLimit-Reset"] = 60 }, render(multi("allowed", 0), "ratelimit"))
        assert.same({ ["RateLimit-Limit"] = 5, ["RateLimit-Remaining"] = 4, ["RateLimit-Reset"] = 60 }, render(multi("allowed", 0), "ratelimit", hidden))
        assert.same({}, render({ decision = "allowed", source = "redis", limit = 1, remaining = 0, policy = "next" }, "x", hidden))
    end)

    it("never shows a shadow policy with room that the daemon marked, declared or not", function()
        -- Issue 22, defect 3: the daemon marks every shadow item, so an
        -- undeclared one with room (limit 1, remaining 0: the most
        -- constrained) is hidden in every style without the shadow option.
        for _, hidden in ipairs({ false, { next = true } }) do
            local h = hidden or nil
            local want = { ["RateLimit-Limit"] = 5, ["RateLimit-Remaining"] = 4, ["RateLimit-Reset"] = 60 }
            assert.same(want, render(multi("shadow_allowed", 0), "ratelimit", h))
            assert.same({ ["X-RateLimit-Limit"] = 5, ["X-RateLimit-Remaining"] = 4, ["X-RateLimit-Reset"] = 60 }, render(multi("shadow_allowed", 0), "x", h))
            local out = render(multi("shadow_allowed", 0), "draft", h)
            assert.equals('"per_ip";q=10;w=60, "per_tenant";q=5;w=60', out["RateLimit-Policy"])
            assert.equals('"per_ip";r=9;t=60, "per_tenant";r=4;t=60', out["RateLimit"])
        end
        -- A one-policy limiter of a shadow policy: nothing shown, in any style.
        for _, decision in ipairs({ "shadow_allowed", "shadow_denied" }) do
            local res = { decision = decision, source = "redis", limit = 1, remaining = 0, reset_ms = 60000, retry_after_ms = 0, window_ms = 60000, policy = "next" }
            for _, style in ipairs({ "ratelimit", "x", "draft" }) do
                assert.same({}, render(res, style))
            end
        end
        -- Only shadow items: no quota at all.
        local only = { decision = "allowed", source = "redis", items = { item("next", "shadow_allowed", 1, 0) } }
        for _, style in ipairs({ "ratelimit", "x", "draft" }) do
            assert.same({}, render(only, style))
        end
    end)

    it("shows the refusing policy in the legacy styles, and names it in the problem body", function()
        local res = { decision = "denied", source = "redis", items = {
            item("per_ip", "allowed", 10, 1),
            item("per_tenant", "denied", 5, 0),
            item("global", "denied", 100, 0, { source = "none" }),
        } }
        assert.same({ ["X-RateLimit-Limit"] = 5, ["X-RateLimit-Remaining"] = 0, ["X-RateLimit-Reset"] = 60 }, render(res, "x"))
        -- global was not evaluated (source none): not listed.
        assert.equals('"per_ip";r=1;t=60, "per_tenant";r=0;t=3', render(res, "draft")["RateLimit"])
        assert.matches('"violated%-policies":%["per_tenant"%]', http.problem_body(res, 429))
        assert.matches('"status":429', http.problem_body(res, 429))
    end)
end)

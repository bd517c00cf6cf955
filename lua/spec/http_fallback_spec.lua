-- The location's fail policy when the daemon gives no decision
-- (resty/ratelimitd/http.lua, fallback and fallback_many): open,
-- closed, and the local quota's arithmetic (an approximate sliding window
-- in the shared dict: the previous fixed window weighted by its overlap,
-- plus the current one), one key and all or nothing for several.

local now = 1000.0 -- s
local logged = {}

-- The subset of ngx.shared.DICT the fallback uses.
local function dict()
    local values = {}
    return {
        get = function(_, k) return values[k] end,
        incr = function(_, k, by, init)
            values[k] = (values[k] or init or 0) + by
            return values[k], nil, false
        end,
        values = values,
    }
end

local shared = { ratelimitd = dict() }
rawset(_G, "ngx", {
    ERR = 4,
    now = function() return now end,
    log = function(_, ...) logged[#logged + 1] = table.concat({ ... }) end,
    shared = shared,
})

-- http.lua's request.lua reads resty.core's request getter when loaded: a
-- stand-in, as request_spec.lua makes it; nothing here calls it.
package.loaded["resty.core.base"] = package.loaded["resty.core.base"] or { get_request = function() return nil end }
local http = require "resty.ratelimitd.http"
-- The fail policy under the names the assertions use.
local fallback = { one = http.fallback, many = http.fallback_many }

local function lim(on_error)
    return { _on_error = on_error, _limit = 100, _local_limit = 3, _window_ms = 1000 }
end

describe("fallback", function()
    before_each(function()
        shared.ratelimitd = dict()
        now = 1000.0
        logged = {}
    end)

    it("lets through with open and refuses with closed, logging why", function()
        local res = fallback.one(lim("open"), "k", 1, "connect: refused")
        assert.same({ allowed = true, decision = "allowed", source = "lua_fail_open", limit = 100 }, res)
        res = fallback.one(lim("closed"), "k2", 1, "timeout")
        assert.same({ allowed = false, decision = "denied", source = "lua_fail_closed", limit = 100, retry_after_ms = 1000 }, res)
        assert.matches("ratelimitd: fail_open key=k reason=\"connect: refused\"", logged[1], 1, true)
        assert.matches("ratelimitd: fail_closed key=k2 reason=\"timeout\"", logged[2], 1, true)
    end)

    it("admits the local quota per window, then refuses and gives the cost back", function()
        local l = lim("local")
        local got = {}
        for _ = 1, 4 do
            local res = fallback.one(l, "k", 1, "down")
            got[#got + 1] = res.decision .. ":" .. res.remaining
        end
        assert.same({ "allowed:2", "allowed:1", "allowed:0", "denied:0" }, got)
        assert.equals(3, shared.ratelimitd.values["k|1000|1000000"], "the refused cost was given back")
        -- Half way into the next window, half of the previous one still
        -- counts: floor(3 x 0.5) + 1.
        now = 1001.5
        local res = fallback.one(l, "k", 1, "down")
        assert.same({ "allowed", 1, 2, 500 }, { res.decision, res.remaining, res.count, res.reset_ms })
        assert.equals("denied", fallback.one(l, "k", 2, "down").decision)
    end)

    it("checks several keys all or nothing, giving back what the earlier ones took", function()
        local l = lim("local")
        l._names, l._n = { "per_ip", "per_tenant" }, 2
        shared.ratelimitd.values["per_tenant|t1|1000|1000000"] = 3 -- already full
        local res = fallback.many(l, { "ip1", "t1" }, { 1, 1 }, "down")
        assert.same({ false, "per_tenant" }, { res.allowed, res.policy })
        assert.equals(0, shared.ratelimitd.values["per_ip|ip1|1000|1000000"], "per_ip's unit given back")
        res = fallback.many(l, { "ip1", "t2" }, { 1, 1 }, "down")
        assert.same({ true, "lua_local" }, { res.allowed, res.source })
        assert.equals(1, shared.ratelimitd.values["per_ip|ip1|1000|1000000"])
        -- An admission shows its most constrained item's numbers (the
        -- headers need remaining and reset): per_ip holds 2 of 3 now.
        res = fallback.many(l, { "ip1", "t3" }, { 1, 1 }, "down")
        assert.same({ true, "per_ip", 3, 1, 2 }, { res.allowed, res.policy, res.limit, res.remaining, res.count })
        assert.is_true(res.reset_ms > 0)
    end)

    it("counts each policy in its own described window and quota, giving back in the right window", function()
        local l = lim("local")
        l._local_limit, l._window_ms = nil, nil
        l._names, l._n = { "per_ip", "per_tenant" }, 2
        l._windows, l._local_limits = { 1000, 2000 }, { 5, 1 }
        local res = fallback.many(l, { "ip1", "t1" }, { 1, 1 }, "down")
        assert.same({ true, "lua_local" }, { res.allowed, res.source })
        assert.equals(1, shared.ratelimitd.values["per_ip|ip1|1000|1000000"])
        assert.equals(1, shared.ratelimitd.values["per_tenant|t1|2000|1000000"])
        -- per_tenant's quota of 1 is spent: refused, per_ip's unit given back.
        res = fallback.many(l, { "ip1", "t1" }, { 1, 1 }, "down")
        assert.same({ false, "per_tenant" }, { res.allowed, res.policy })
        assert.equals(1, shared.ratelimitd.values["per_ip|ip1|1000|1000000"])
        -- A policy with no quota known: open (one() says why).
        l._local_limits = { 5 }
        res = fallback.many(l, { "ip1", "t1" }, { 1, 1 }, "down")
        assert.same({ true, "lua_fail_open" }, { res.allowed, res.source })
    end)
end)

-- A request's leases across internal redirects (request.lua), with a stand-in for the
-- parts of ngx the module reads: $request_id (indexed: the same at every
-- read of one request), the clock, ngx.ctx.

local now, current = 1000, "req-1"
local logged = {}
rawset(_G, "ngx", {
    ERR = 4,
    now = function() return now end,
    log = function(_, ...) logged[#logged + 1] = table.concat({ ... }) end,
    var = setmetatable({}, { __index = function(_, k) if k == "request_id" then return current end end }),
    ctx = {},
})

-- request.lua finds a request by its nginx request object (lua-resty-core).
package.loaded["resty.core.base"] = { get_request = function() return current end }

local leases = require "resty.ratelimitd.request"

local function lease(name)
    return { "limiter", name, 1, { allowed = true } }
end

describe("leases", function()
    it("keeps a request's leases under its $request_id, across redirects, until taken", function()
        local id, held = leases.leases()
        assert.equals("req-1", id)
        assert.is_nil(held)
        leases.hold(id, lease("a"), 30)
        -- After an internal redirect ngx.ctx is new; the id is the same.
        ngx.ctx = {}
        id, held = leases.leases()
        assert.equals("req-1", id)
        assert.equals("a", held[1][2])
        leases.hold(id, lease("b"), 30)
        assert.equals(1, leases.lease_holders())
        current = "req-2"
        assert.is_nil(select(2, leases.leases()), "another request holds nothing")
        current = "req-1"
        local taken_id, taken = leases.take_leases()
        assert.equals("req-1", taken_id)
        assert.same({ "a", "b" }, { taken[1][2], taken[2][2] })
        assert.is_nil(select(2, leases.take_leases()), "taken once")
        assert.equals(0, leases.lease_holders())
        assert.same({}, logged)
    end)

    it("forgets, once past their lease, the leases of requests that never reached leave()", function()
        for i = 1, 1024 do
            current = "old-" .. i
            leases.hold(current, lease("k"), 30)
        end
        assert.equals(1024, leases.lease_holders())
        now = now + 31
        current = "new"
        -- The 1025th request sweeps: only its own entry is left.
        leases.hold(current, lease("k"), 30)
        assert.equals(1, leases.lease_holders())
        current = "old-1"
        assert.is_nil(select(2, leases.leases()))
    end)
end)

describe("leases without an indexed $request_id", function()
    it("keeps a request's leases under what nginx keeps for it across redirects, and says nothing", function()
        package.loaded["resty.ratelimitd.request"] = nil
        package.loaded["resty.ratelimitd.request"] = nil
        local n = 0
        -- Unindexed, every read of $request_id makes a new one; the
        -- request object, its start, its connection stay.
        local r, start, conn, reqs = "cdata<void *>: 0x55aa10", 1000.25, "7", "1"
        ngx.var = setmetatable({}, { __index = function(_, k)
            if k == "request_id" then n = n + 1; return "fresh-" .. n end
            if k == "connection" then return conn end
            if k == "connection_requests" then return reqs end
        end })
        rawset(ngx, "req", { start_time = function() return start end })
        package.loaded["resty.core.base"] = { get_request = function() return r end }
        ngx.ctx = {}
        logged = {}
        local fresh = require "resty.ratelimitd.request"
        local id, held = fresh.leases()
        assert.is_nil(held)
        -- A lease id: printable, no space or '#', 64 bytes at most.
        assert.is_nil(id:find("[%s#%c]"))
        assert.is_true(#id <= 64)
        fresh.hold(id, lease("a"), 30)
        -- An internal redirect: a new ngx.ctx, the same request.
        ngx.ctx = {}
        local same_id, same = fresh.leases()
        assert.equals(id, same_id)
        assert.equals("a", same[1][2])
        -- The next request of the keep-alive connection, at the same
        -- address and in the same millisecond, is another request.
        reqs = "2"
        assert.is_nil(select(2, fresh.leases()))
        reqs = "1"
        local _, taken = fresh.take_leases()
        assert.equals("a", taken[1][2])
        assert.same({}, logged)
    end)
end)

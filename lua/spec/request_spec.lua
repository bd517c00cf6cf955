-- What a request keeps across internal redirects (request.lua), with a
-- stand-in for the parts of ngx the module reads: the request object's
-- address (resty.core.base.get_request), $connection and
-- $connection_requests and its start time (the same for the whole
-- request), $request_id (indexed: the same at every read) and ngx.ctx.

-- The request being served: its address, connection and number on it.
local current
local function serve(addr, conn, nth, start)
    current = { addr = addr, conn = tostring(conn or addr), nth = tostring(nth or 1), start = start or 1765000000.123 }
end
serve(1)
local VARS = {
    request_id = function() return "indexed" end,
    connection = function() return current.conn end,
    connection_requests = function() return current.nth end,
}
rawset(_G, "ngx", {
    var = setmetatable({}, { __index = function(_, k) return VARS[k] and VARS[k]() end }),
    ctx = {},
    req = { start_time = function() return current.start end },
})
package.loaded["resty.core.base"] = { get_request = function() return current.addr end }

local request = require "resty.ratelimitd.request"

-- One run of the access phase: the decision `lim` made earlier in the
-- request, else `fresh`, recorded.
local function decide(lim, key, cost, fresh)
    local res, e, call = request.decided(lim, key, cost)
    if res then
        return res
    end
    request.remember(e, lim, call, fresh)
    return fresh
end

describe("request", function()
    it("gives the same limiter the same request's first decision of a key and cost again, and nothing else", function()
        local lim, other = {}, {}
        local first = { allowed = true }
        assert.equals(first, decide(lim, "k", 1, first))
        -- After an internal redirect ngx.ctx is new; the id is the same.
        ngx.ctx = {}
        assert.equals(first, decide(lim, "k", 1, { allowed = false }))
        assert.is_nil(request.decided(other, "k", 1), "another limiter decides on its own")
        assert.is_nil(request.decided(lim, "k", 2), "another cost is another call")
        assert.is_nil(request.decided(lim, "k2", 1), "another key is another call")
        -- A key list and a cost list name one call, whatever their pieces.
        local many = { allowed = true }
        assert.equals(many, decide(lim, { "a", "b" }, { 1, 2 }, many))
        assert.equals(many, request.decided(lim, { "a", "b" }, { 1, 2 }))
        assert.is_nil(request.decided(lim, { "a", "b" }, { 2, 1 }))
        assert.is_nil(request.decided(lim, { "a\1b" }, 1))
        serve(2)
        assert.is_nil(request.decided(lim, { "a", "b" }, { 1, 2 }), "another request has decided nothing")
    end)

    it("never takes an earlier request's decision at the same address for this one's", function()
        local lim = {}
        local first = { allowed = true }
        serve(7, 70, 1)
        assert.equals(first, decide(lim, "k", 1, first))
        assert.equals(first, request.decided(lim, "k", 1), "the same request after a redirect")
        -- nginx placed the next request of the connection at the same address.
        serve(7, 70, 2)
        assert.is_nil(request.decided(lim, "k", 1), "the connection's next request")
        local second = { allowed = false }
        assert.equals(second, decide(lim, "k", 1, second))
        -- A request of another connection at that address, with the same number on it.
        serve(7, 71, 2)
        assert.is_nil(request.decided(lim, "k", 1), "another connection's request")
        assert.is_nil(request.decision(), "nor its decision table")
        serve(7, 70, 2)
        assert.is_nil(request.decided(lim, "k", 1), "an address holds the last request's entry only")
    end)

    it("keeps decisions without the snippet's map line too ($request_id new at each read)", function()
        -- A fresh copy of the module: it looks at $request_id once per worker.
        package.loaded["resty.ratelimitd.request"] = nil
        local n = 0
        VARS.request_id = function() n = n + 1 return "id-" .. n end
        local fresh = require "resty.ratelimitd.request"
        local lim = {}
        serve(9)
        local first = { allowed = true }
        local res, e, call = fresh.decided(lim, "k", 1)
        assert.is_nil(res)
        fresh.remember(e, lim, call, first)
        ngx.ctx = {}
        assert.equals(first, fresh.decided(lim, "k", 1), "found again after a redirect, by the request's address")
        -- Its identity (a lease's id) is what nginx keeps for the request.
        local id = fresh.id()
        assert.equals(id, fresh.id())
        assert.is_nil(id:find("[ #]"))
        VARS.request_id = function() return "indexed" end
        package.loaded["resty.ratelimitd.request"] = request
    end)

    it("keeps the decision table for after a redirect, which clears ngx.ctx", function()
        serve(3)
        assert.is_nil(request.decision())
        local res = { handle = "h" }
        request.keep(res)
        ngx.ctx = {}
        assert.equals(res, request.decision())
        local here = { handle = "here" }
        ngx.ctx = { ratelimitd = here }
        assert.equals(here, request.decision(), "this location's own first")
        ngx.ctx = {}
        serve(4)
        assert.is_nil(request.decision())
    end)

    it("holds at most two generations of requests", function()
        local lim = {}
        serve(100000)
        decide(lim, "k", 1, { allowed = true })
        for i = 1, request.GENERATION - 2 do
            serve(200000 + i)
            decide(lim, "k", 1, { allowed = true })
        end
        serve(100000)
        assert.is_not_nil(request.decided(lim, "k", 1), "found within a generation")
        for i = 1, 2 * request.GENERATION + 1 do
            serve(300000 + i)
            decide(lim, "k", 1, { allowed = true })
        end
        serve(100000)
        assert.is_nil(request.decided(lim, "k", 1), "forgotten two generations later")
    end)
end)

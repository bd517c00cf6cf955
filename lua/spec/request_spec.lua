-- What a request keeps across internal redirects (request.lua), with a
-- stand-in for the parts of ngx the module reads: $request_id (indexed:
-- the same at every read of one request) and ngx.ctx.

local current = "req-1"
rawset(_G, "ngx", {
    var = setmetatable({}, { __index = function(_, k) if k == "request_id" then return current end end }),
    ctx = {},
})

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
        current = "req-2"
        assert.is_nil(request.decided(lim, { "a", "b" }, { 1, 2 }), "another request has decided nothing")
    end)

    it("keeps the decision table for after a redirect, which clears ngx.ctx", function()
        current = "req-ctx"
        assert.is_nil(request.decision())
        local res = { handle = "h" }
        request.keep(res)
        ngx.ctx = {}
        assert.equals(res, request.decision())
        local here = { handle = "here" }
        ngx.ctx = { ratelimitd = here }
        assert.equals(here, request.decision(), "this location's own first")
        ngx.ctx = {}
        current = "req-other"
        assert.is_nil(request.decision())
    end)

    it("holds at most two generations of requests", function()
        local lim = {}
        current = "kept"
        decide(lim, "k", 1, { allowed = true })
        for i = 1, request.GENERATION - 2 do
            current = "r" .. i
            decide(lim, "k", 1, { allowed = true })
        end
        current = "kept"
        assert.is_not_nil(request.decided(lim, "k", 1), "found within a generation")
        for i = 1, 2 * request.GENERATION + 1 do
            current = "s" .. i
            decide(lim, "k", 1, { allowed = true })
        end
        current = "kept"
        assert.is_nil(request.decided(lim, "k", 1), "forgotten two generations later")
    end)
end)

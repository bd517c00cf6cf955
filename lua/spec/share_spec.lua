-- Worker shares in the shared dict (resty/ratelimitd/share.lua): the take
-- never admits more units than granted nor after the deadline, and a
-- refill asks the daemon only for a hot key, never replaces a live share.
-- A plain table stands in for the shared dict, a settable clock for
-- CLOCK_MONOTONIC and a recorder for the daemon's socket.

local wire = require "resty.ratelimitd.wire"

local now_us = 0
local sent = {}
local answer -- the 32 bytes of prefix and fixed fields the "daemon" answers
package.loaded["resty.ratelimitd.cache"] = { mono_us = function() return now_us end }
package.loaded["resty.ratelimitd.conn"] = {
    next_id = function() return 7 end,
    transact = function(frame)
        sent[#sent + 1] = frame
        return answer
    end,
}
package.loaded["resty.ratelimitd.share"] = nil
local share = require "resty.ratelimitd.share"

-- The subset of ngx.shared.DICT share.lua uses (no expiry: the tests set
-- the clock, and the deadline is in the value).
local function dict()
    local values, flags = {}, {}
    return {
        get = function(_, k) return values[k], flags[k] end,
        incr = function(_, k, by)
            if type(values[k]) ~= "number" then
                return nil, "not found"
            end
            values[k] = values[k] + by
            return values[k]
        end,
        safe_set = function(_, k, v, _, f)
            values[k], flags[k] = v, f
            return true
        end,
        safe_add = function(_, k, v, _, f)
            if values[k] ~= nil then
                return false, "exists"
            end
            values[k], flags[k] = v, f
            return true
        end,
        delete = function(_, k) values[k] = nil end,
        values = values,
    }
end

-- A response to op 10: units, room outside, valid ms, window.
local function granted(units, outside, valid_ms, window)
    local body = string.char(1, 10) .. wire.u32(7) .. string.char(0, 0) .. wire.u32(units) .. wire.u32(outside)
        .. wire.u32(valid_ms) .. wire.u32(window) .. string.char(0, 0, 0, 0)
    return wire.u32(#body) .. body
end

local lim = { _name_part = "\3hot", _policy = "hot", _header = wire.policy_header(0, "closed", 1, 0) }
local admitted = { decision = "allowed", source = "redis", count = 10, remaining = 990 }

-- Makes the key hot (8 daemon admissions) and refills it at `at_us`.
local function refilled(d, key, at_us, units, valid_ms)
    now_us = at_us
    answer = granted(units, 500, valid_ms, 60000)
    for _ = 1, 9 do
        share.refill(lim, d, key, admitted)
    end
end

describe("worker shares", function()
    before_each(function()
        sent = {}
    end)

    it("asks the daemon only once the key is hot on the host, with the op 10 frame", function()
        local d = dict()
        now_us = 1e9
        answer = granted(16, 500, 200, 60000)
        for _ = 1, 7 do
            share.refill(lim, d, "k", admitted)
        end
        assert.equals(0, #sent, "7 daemon admissions: not hot yet")
        share.refill(lim, d, "k", admitted)
        assert.equals(1, #sent)
        assert.equals(wire.lease_share(7, lim._header, 128, "\3hot", "k"), sent[1])
    end)

    it("admits exactly the units granted, then nothing", function()
        local d = dict()
        refilled(d, "k", 1e9, 3, 200)
        local first = share.admit(lim, d, "k", 2)
        assert.same({ allowed = true, decision = "allowed", source = "redis", count = 499, remaining = 501,
                      retry_after_ms = 0, reset_ms = 60000, error_code = 0, error = "OK", message = "", limit = 1000,
                      policy = "hot", shared = true }, first)
        local before = d.values["\2\3hotk"]
        assert.is_nil(share.admit(lim, d, "k", 2), "1 unit left, cost 2")
        assert.equals(before, d.values["\2\3hotk"], "an overdraw is given back")
        assert.is_not_nil(share.admit(lim, d, "k", 1))
        assert.is_nil(share.admit(lim, d, "k", 1), "spent")
        assert.is_nil(share.admit(lim, d, "other", 1), "no share for another key")
    end)

    it("a take that meets a borrowed value admits nothing while it is given back", function()
        local d = dict()
        refilled(d, "k", 1e9, 1, 200)
        -- A worker overdraws (cost 3 of 1) and has not given back yet.
        d:incr("\2\3hotk", -3)
        assert.is_nil(share.admit(lim, d, "k", 1), "the low part is above 255: nothing to take")
        d:incr("\2\3hotk", 3)
        assert.is_not_nil(share.admit(lim, d, "k", 1))
    end)

    it("admits only before the deadline: the send plus the validity, whole ms", function()
        local d = dict()
        refilled(d, "k", 1e9 + 999, 100, 200) -- sent at 1,000,000.999 ms: counted from 1,000,000 ms
        now_us = 1e9 + 199999
        assert.is_not_nil(share.admit(lim, d, "k", 1))
        now_us = 1e9 + 200000
        assert.is_nil(share.admit(lim, d, "k", 1), "at the deadline")
    end)

    it("never replaces a live share, and waits after a refill that got nothing", function()
        local d = dict()
        refilled(d, "k", 1e9, 50, 200)
        local live = d.values["\2\3hotk"]
        d:delete("\2\3hotk\4")
        answer = granted(80, 500, 200, 60000)
        share.refill(lim, d, "k", admitted)
        assert.equals(live, d.values["\2\3hotk"], "the live share stays")
        local d2 = dict()
        refilled(d2, "k", 1e9, 0, 0)
        local asked = #sent
        answer = granted(80, 500, 200, 60000)
        share.refill(lim, d2, "k", admitted)
        assert.equals(asked, #sent, "no second ask while the guard of a refill that got nothing lasts")
    end)

    it("waits after an error answer too (a daemon older than op 10)", function()
        local d = dict()
        now_us = 1e9
        local body = string.char(1, 10) .. wire.u32(7) .. string.char(2, 255) .. string.rep("\0", 16) .. string.char(0, 3, 0, 0)
        answer = wire.u32(#body) .. body
        for _ = 1, 12 do
            share.refill(lim, d, "old", admitted)
        end
        assert.equals(1, #sent, "one ask, then the guard")
        assert.is_nil(d.values["\2\3hotold"])
    end)

    it("never shares a cost above 255 nor a limit it cannot pack", function()
        local d = dict()
        refilled(d, "k", 1e9, 255, 200)
        assert.is_nil(share.admit(lim, d, "k", 256))
        local d2 = dict()
        now_us = 1e9
        for _ = 1, 9 do
            share.refill(lim, d2, "big", { decision = "allowed", source = "redis", count = 1, remaining = 2 ^ 26 })
        end
        assert.is_nil(d2.values["\2\3hotbig"])
    end)
end)

-- Worker shares in the shared dict (resty/ratelimitd/share.lua): the take
-- never admits more units than granted nor after the deadline, and a
-- refill asks the daemon only for a hot key, never replaces a live share.
-- A plain table stands in for the shared dict, a settable clock for
-- CLOCK_MONOTONIC and a recorder for the daemon's socket.

local wire = require "resty.ratelimitd.wire"

local now_us = 0
-- ngx.now(), the worker's cached clock in s: what the hit counts' generations follow.
local now_s = 1000
_G.ngx = _G.ngx or { socket = { tcp = function() end }, log = function() end, ERR = 4, WARN = 5, INFO = 7 }
local stub = _G.ngx
stub.now = function() return now_s end
local phase = "access"
stub.get_phase = function() return phase end
local sent = {}
-- ngx.timer.at's timers, run by hand: { delay, handler, args }.
local timers = {}
stub.timer = { at = function(delay, fn, ...) timers[#timers + 1] = { delay, fn, { ... } } return true end }
local answer -- the 32 bytes of prefix and fixed fields the "daemon" answers
package.loaded["resty.ratelimitd.conn"] = {
    mono_us = function() return now_us end,
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
    local values, flags, exptimes = {}, {}, {}
    return {
        get = function(_, k) return values[k], flags[k] end,
        incr = function(_, k, by)
            if type(values[k]) ~= "number" then
                return nil, "not found"
            end
            values[k] = values[k] + by
            return values[k]
        end,
        safe_set = function(_, k, v, exptime, f)
            values[k], flags[k], exptimes[k] = v, f, exptime
            return true
        end,
        safe_add = function(_, k, v, _, f)
            if values[k] ~= nil then
                return false, "exists"
            end
            values[k], flags[k] = v, f
            return true
        end,
        expire = function() return true end,
        delete = function(_, k) values[k] = nil end,
        values = values,
        exptimes = exptimes,
    }
end

-- A response to op 10: units, room outside, valid ms, window.
local function granted(units, outside, valid_ms, window)
    local body = string.char(1, 10) .. wire.u32(7) .. string.char(0, 0) .. wire.u32(units) .. wire.u32(outside)
        .. wire.u32(valid_ms) .. wire.u32(window) .. string.char(0, 0, 0, 0)
    return wire.u32(#body) .. body
end

-- A policy limiter's fields share.lua reads, and its frame (policy.lua's).
local lim = { _name_part = "\3hot", _policy = "hot", _header = wire.policy_header(0, "closed", 1, 0), _share_prefix = "\2\3hot" }
function lim._share_frame(self, id, units, key, back)
    return wire.lease_share(id, self._header, units, self._name_part, key, back)
end
local admitted = { decision = "allowed", source = "redis", count = 10, remaining = 990 }

-- Makes the key hot (8 daemon admissions) and refills it at `at_us`.
local function refilled(d, key, at_us, units, valid_ms)
    now_us = at_us
    answer = granted(units, 500, valid_ms, 60000)
    for _ = 1, 8 do
        share.refill(lim, d, key, admitted)
    end
end

describe("worker shares", function()
    before_each(function()
        sent, timers = {}, {}
        -- Each test's keys start cold: the worker's counts are two
        -- generations of at most 1 s each.
        now_s = now_s + 10
    end)

    it("keeps shares in configure()'s shared_dict unless the limiter names another or false, or shares are off", function()
        local saved = stub.shared
        local d, other = dict(), dict()
        stub.shared = { ratelimitd = d }
        local settings = { shares = true, shared_dict = "ratelimitd" }
        assert.equals(d, share.dict({}, settings))
        assert.equals(other, share.dict({ _share_dict = other }, settings))
        assert.is_nil(share.dict({ _share_dict = false }, settings))
        settings.shared_dict = "not_declared"
        assert.is_nil(share.dict({}, settings), "no dict: no shares")
        settings.shared_dict, settings.shares = "ratelimitd", false
        assert.is_nil(share.dict({}, settings), "configure{ shares = false }")
        stub.shared = saved
    end)

    it("takes no share for an inline limiter of another algorithm than the log, with shares on", function()
        -- The daemon leases the log's windows only; a GCRA limiter asked
        -- for a share with no share frame to send (a Lua error, a 500).
        -- limiter.lua's requires reach request.lua, which reads nginx's
        -- request object through resty.core.base: not loaded here.
        local base = package.loaded["resty.core.base"]
        package.loaded["resty.core.base"] = base or { get_request = function() end }
        local limiter = require "resty.ratelimitd.limiter"
        package.loaded["resty.core.base"] = base
        local saved = stub.shared
        stub.shared = { ratelimitd = dict() }
        local settings = { shares = true, shared_dict = "ratelimitd" }
        for _, algorithm in ipairs({ "gcra", "ring", "fixed", "sliding_counter" }) do
            local inline = limiter.build(100, 1000, "open", nil, algorithm)
            assert.is_false(inline._share_dict, algorithm)
            assert.is_nil(share.dict(inline, settings), algorithm)
        end
        assert.equals(stub.shared.ratelimitd, share.dict(limiter.build(100, 1000, "open", nil, "log"), settings))
        stub.shared = saved
    end)

    -- A dict whose key(s) the daemon admitted 7 times, one short of hot,
    -- and the daemon's answer to a share request: 16 units.
    local function seven_admissions(...)
        local d = dict()
        now_us = 1e9
        answer = granted(16, 500, 200, 60000)
        for _, key in ipairs({ ... }) do
            for _ = 1, 7 do
                share.refill(lim, d, key, admitted)
            end
        end
        return d
    end

    it("asks the daemon only once the key is hot on the host, with the op 10 frame", function()
        local d = seven_admissions("k")
        assert.equals(0, #sent, "7 daemon admissions: not hot yet")
        share.refill(lim, d, "k", admitted)
        assert.equals(1, #sent)
        assert.equals(wire.lease_share(7, lim._header, 64, "\3hot", "k"), sent[1])
        assert.is_nil(d.values["\2\3hotk\5"], "the counts are the worker's, not the dict's")
    end)

    it("counts a key's admissions over the last one to two seconds only", function()
        local d = seven_admissions("slow")
        now_s = now_s + 1.5
        share.refill(lim, d, "slow", admitted)
        assert.equals(1, #sent, "8 admissions within 1.5 s (the generation before is carried on): hot")
        for _ = 1, 7 do
            share.refill(lim, d, "slower", admitted)
        end
        now_s = now_s + 2.5
        share.refill(lim, d, "slower", admitted)
        now_s = now_s + 1.1
        share.refill(lim, d, "slower", admitted)
        assert.equals(1, #sent, "7 admissions, then 1 every 2.5 s and 1.1 s: never 8 within two generations")
    end)

    it("asks again as soon as the daemon says while its lease call is in flight, never later than 100 ms", function()
        local d = dict()
        refilled(d, "k", 1e9, 0, 1)
        assert.equals(1, #sent)
        assert.equals(0.001, d.exptimes["\2\3hotk\4"], "no units, ask again in 1 ms: the guard lasts 1 ms")
        local d2 = dict()
        refilled(d2, "k", 1e9, 0, 0)
        assert.equals(0.1, d2.exptimes["\2\3hotk\4"], "no units and no time said: 100 ms")
        local d3 = dict()
        refilled(d3, "k", 1e9, 0, 4000000000)
        assert.equals(0.1, d3.exptimes["\2\3hotk\4"], "a daemon's long wait is capped at 100 ms")
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
        -- Where no cosocket may be opened: the take within 8 ms of the
        -- deadline gives nothing back, asks for nothing.
        phase = "header_filter"
        now_us = 1e9 + 199999
        assert.is_not_nil(share.admit(lim, d, "k", 1))
        now_us = 1e9 + 200000
        assert.is_nil(share.admit(lim, d, "k", 1), "at the deadline")
        phase = "access"
    end)

    it("adds to a live share under its earlier deadline, replaces a spent or late one, and waits after a refill that got nothing", function()
        local d = dict()
        refilled(d, "k", 1e9, 20, 200)
        local live = d.values["\2\3hotk"]
        assert.equals(1000200 * 65536 + 20, live, "deadline: the send (1,000,000 ms) plus 200 ms; 20 units")
        d:delete("\2\3hotk\4")
        answer = granted(80, 500, 200, 60000)
        share.refill(lim, d, "k", admitted)
        assert.equals(live + 80, d.values["\2\3hotk"], "fewer than 32 left: 80 more under the live (earlier) deadline")
        d:delete("\2\3hotk\4")
        share.refill(lim, d, "k", admitted)
        assert.equals(live + 80, d.values["\2\3hotk"], "100 left: no round trip")
        -- Spent: replaced by the new share and its own deadline.
        d.values["\2\3hotk"] = 1000200 * 65536
        d:delete("\2\3hotk\4")
        now_us = 1e9 + 5000
        share.refill(lim, d, "k", admitted)
        assert.equals(1000205 * 65536 + 80, d.values["\2\3hotk"])
        assert.near(0.198, timers[#timers][1], 1e-9, "the give-back timer of the new share, not the spent one's")
        -- Past its deadline with units left: replaced, the old ones given
        -- back (no take had them: takes after the deadline admit nothing).
        d:delete("\2\3hotk\4")
        now_us = 1e9 + 300000
        d.values["\2\3hotk"] = 1000205 * 65536 + 10
        share.refill(lim, d, "k", admitted)
        assert.equals(1000500 * 65536 + 80, d.values["\2\3hotk"])
        assert.equals(wire.lease_share(7, lim._header, 10, "\3hot", "k", true), sent[#sent])
        local d2 = dict()
        refilled(d2, "k", 1e9, 0, 0)
        local asked = #sent
        answer = granted(80, 500, 200, 60000)
        share.refill(lim, d2, "k", admitted)
        assert.equals(asked, #sent, "no second ask while the guard of a refill that got nothing lasts")
    end)

    it("tops the share up from the take that leaves fewer than 32 units, and only that one", function()
        local d = dict()
        refilled(d, "k", 1e9, 34, 200)
        local asked = #sent
        answer = granted(100, 500, 200, 60000)
        assert.is_not_nil(share.admit(lim, d, "k", 1))
        assert.equals(asked, #sent, "33 left")
        assert.is_not_nil(share.admit(lim, d, "k", 1))
        assert.equals(asked, #sent, "32 left")
        local res = share.admit(lim, d, "k", 1)
        assert.equals(asked + 1, #sent, "31 left: topped up")
        assert.equals(31, res.remaining - 500, "the answer counts the units left when taken")
        assert.equals(1000200 * 65536 + 131, d.values["\2\3hotk"])
        assert.is_nil(d.values["\2\3hotk\4"], "the guard is gone: the next top-up may come")
        for _ = 1, 100 do
            share.admit(lim, d, "k", 1)
        end
        assert.equals(asked + 2, #sent, "one top-up per crossing")
        phase = "header_filter"
        for _ = 1, 100 do
            share.admit(lim, d, "k", 1)
        end
        phase = "access"
        assert.equals(asked + 2, #sent, "no cosocket where the phase has none: the take admits, no top-up")
    end)

    it("never grants a unit twice when a take gives back between the refill's read and write", function()
        local d = dict()
        refilled(d, "k", 1e9, 2, 200)
        -- A take of 3 borrows (2 left) ...
        assert.is_nil(share.admit(lim, d, "k", 3))
        -- ... and a take borrows while the refill's answer is on its way:
        -- the refill reads a borrowed entry and burns its units.
        local get = d.get
        d.get = function(self, k)
            local v, f = get(self, k)
            if k == "\2\3hotk" then
                self.values[k] = self.values[k] - 5
                d.get = get
                return v - 5, f
            end
            return v, f
        end
        d:delete("\2\3hotk\4")
        answer = granted(100, 500, 200, 60000)
        share.refill(lim, d, "k", admitted)
        d:incr("\2\3hotk", 5) -- the borrowing take gives back
        assert.equals(1000200 * 65536 + 2, d.values["\2\3hotk"], "the 100 units were burnt, the 2 remain")
        -- A give-back that lands between the read and the write of a replace.
        d.values["\2\3hotk"] = 1000200 * 65536
        d:delete("\2\3hotk\4")
        local incr = d.incr
        d.incr = function(self, k, by)
            d.incr = incr
            incr(self, k, -1) -- a take of 1 that will borrow ...
            local r = incr(self, k, by)
            incr(self, k, 1) -- ... and gives back after the write
            return r
        end
        share.refill(lim, d, "k", admitted)
        assert.equals(1000200 * 65536 + 100, d.values["\2\3hotk"], "exactly the 100 granted")
    end)

    it("gives the units no take had back before the deadline: by its timer, or by the take that renews the share", function()
        local d = dict()
        refilled(d, "k", 1e9, 20, 200)
        assert.equals(1, #timers)
        assert.near(0.198, timers[1][1], 1e-9, "2 ms before the deadline")
        assert.is_not_nil(share.admit(lim, d, "k", 5))
        local asked = #sent
        timers[1][2](false, unpack(timers[1][3]))
        assert.equals(asked + 1, #sent)
        assert.equals(wire.lease_share(7, lim._header, 15, "\3hot", "k", true), sent[#sent], "the 15 left, flag 0x0001")
        assert.equals(15, d.values["\2\3hotk"], "deadline 0: ...")
        assert.is_nil(share.admit(lim, d, "k", 1), "... no take admits after the give-back")
        -- A take within 8 ms of the deadline is admitted, gives the units
        -- left back and asks for fresh ones; the timer then finds the
        -- entry renewed and gives nothing.
        local d2 = dict()
        timers = {}
        refilled(d2, "k", 1e9, 40, 200)
        now_us = 1e9 + 193000
        answer = granted(64, 500, 200, 60000)
        asked = #sent
        assert.is_not_nil(share.admit(lim, d2, "k", 1))
        assert.equals(asked + 2, #sent)
        assert.equals(wire.lease_share(7, lim._header, 39, "\3hot", "k", true), sent[asked + 1])
        assert.equals(wire.lease_share(7, lim._header, 64, "\3hot", "k"), sent[asked + 2])
        assert.equals(1000393 * 65536 + 64, d2.values["\2\3hotk"], "the fresh share under its own deadline")
        assert.equals(2, #timers)
        timers[1][2](false, unpack(timers[1][3]))
        assert.equals(asked + 2, #sent, "renewed: nothing for the old share's timer")
        assert.equals(1000393 * 65536 + 64, d2.values["\2\3hotk"])
    end)

    it("adds a share that ends first to the live one under its own deadline, with a timer for it", function()
        local d = dict()
        refilled(d, "k", 1e9, 20, 200)
        d:delete("\2\3hotk\4")
        now_us = 1e9 + 10000
        answer = granted(50, 500, 100, 60000)
        share.refill(lim, d, "k", admitted)
        assert.equals(1000110 * 65536 + 70, d.values["\2\3hotk"], "the 20 and the 50 until the earlier deadline")
        assert.equals(2, #timers)
        assert.near(0.098, timers[2][1], 1e-9, "2 ms before the new deadline")
        local asked = #sent
        timers[1][2](false, unpack(timers[1][3]))
        assert.equals(asked, #sent, "the old deadline's timer gives nothing")
        timers[2][2](false, unpack(timers[2][3]))
        assert.equals(wire.lease_share(7, lim._header, 70, "\3hot", "k", true), sent[#sent])
    end)

    it("gives nothing back while a take borrows, nor twice", function()
        local d = dict()
        refilled(d, "k", 1e9, 3, 200)
        d:incr("\2\3hotk", -5) -- a take of 5 borrows and has not given back yet
        local asked = #sent
        timers[1][2](false, unpack(timers[1][3]))
        assert.equals(asked, #sent, "a borrowed entry: nothing given back")
        d:incr("\2\3hotk", 5)
        assert.equals(1000200 * 65536 + 3, d.values["\2\3hotk"], "the entry as it was")
        timers[1][2](false, unpack(timers[1][3]))
        timers[1][2](false, unpack(timers[1][3]))
        assert.equals(asked + 1, #sent, "given back once")
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

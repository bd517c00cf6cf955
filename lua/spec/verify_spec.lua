-- How a worker's limiters say they use a policy (resty/ratelimitd/verify.lua):
-- each kind of limiter its use bit (docs/PROTOCOL.md 4g), and a daemon of an
-- earlier release, which answers the uses byte with UNSUPPORTED_FLAGS, is
-- asked again without it. A recorder stands in for the daemon's socket.

local wire = require "resty.ratelimitd.wire"

_G.ngx = _G.ngx or { socket = { tcp = function() end }, log = function() end, ERR = 4, WARN = 5, INFO = 7 }
local sent, answers = {}, {}
package.loaded["resty.ratelimitd.conn"] = {
    next_id = function() return 7 end,
    transact = function(frame)
        sent[#sent + 1] = frame
        return table.remove(answers, 1), ""
    end,
}
package.loaded["resty.ratelimitd.verify"] = nil
local desc = require "resty.ratelimitd.verify"

local function hex(s)
    return (s:gsub("..", function(h) return string.char(tonumber(h, 16)) end))
end

local USE = wire.USE
-- A description of a rate policy of the log, limit 1000, window 60 s.
local DESCRIPTION = hex("0000001c010800000007" .. "00ff" .. "000003e8" .. "00000000" .. "0000ea60" .. "0000ff00" .. "0000" .. "0000")
-- What a daemon without uses answers to the flag: UNSUPPORTED_FLAGS (4).
local OLD_DAEMON = hex("0000001c010800000007" .. "02ff" .. string.rep("00", 16) .. "0004" .. "0000")

describe("describe: uses", function()
    it("gives each kind of limiter its use", function()
        assert.equals(USE.single, desc.uses({ _policy = "a" }))
        assert.equals(USE.single + USE.share, desc.uses({ _policy = "a", _share_dict = {} }))
        assert.equals(USE.multi, desc.uses({ _policy = "a", _names = { "a", "b" }, _flags = 0 }))
        assert.equals(USE.refundable, desc.uses({ _policy = "a", _names = { "a" }, _flags = wire.FLAG_REFUNDABLE }))
        assert.equals(USE.refundable + USE.multi, desc.uses({ _policy = "a", _names = { "a", "b" }, _flags = wire.FLAG_REFUNDABLE }))
        assert.equals(USE.reserve, desc.uses({ _policy = "a", _names = { "a" }, _flags = wire.FLAG_SETTLE }))
        assert.equals(USE.single, desc.uses({ _policy = "a", _names = { "a" }, _flags = 0 }))
        assert.equals(USE.acquire, desc.uses({ _policy = "a", _kind_wanted = "concurrency" }))
    end)

    it("sends the uses byte, and asks a daemon that does not take it again without", function()
        answers = { DESCRIPTION }
        local d = desc.describe("login", USE.multi)
        assert.equals(1000, d.limit)
        assert.equals(wire.describe(7, "login", USE.multi), sent[#sent])
        answers = { OLD_DAEMON, DESCRIPTION }
        d = desc.describe("login", USE.refundable)
        assert.equals(60000, d.window_ms)
        assert.equals(wire.describe(7, "login"), sent[#sent])
        -- From then on, this worker sends none.
        answers = { DESCRIPTION }
        assert.truthy(desc.describe("login", USE.multi))
        assert.equals(wire.describe(7, "login"), sent[#sent])
    end)
end)

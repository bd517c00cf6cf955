-- The SETTLE frame (PROTOCOL.md 4f) built from a reserve's handle: every
-- item's cost replaced by the actual, against the daemon's golden hex
-- (src/protocol/request.rs, reserve_and_settle_frames_match_their_documented_hex).

-- settle.lua's neighbours read ngx when loaded; nothing here calls them.
_G.ngx = _G.ngx or { socket = { tcp = function() end }, now = function() return 0 end, log = function() end, ERR = 4, WARN = 5, INFO = 7 }
local settle = require "resty.ratelimitd.settle"

local function tohex(s)
    return (s:gsub(".", function(c) return string.format("%02x", c:byte()) end))
end

local function item(cost, name, key)
    return string.char(0, 0, math.floor(cost / 256), cost % 256, 0, #key, #name) .. name .. key
end

describe("settle: frames", function()
    it("repeats every item of a reserve of two policies with the actual", function()
        local handle = string.char(2) .. string.rep("\171", 16) .. item(500, "m", "t1") .. item(500, "mo", "t1")
        assert.equals("0000002f01090000000a00000002" .. string.rep("ab", 16) .. "000002bc0002016d7431000002bc0002026d6f7431",
                      tohex(settle._frame(10, handle, 700)))
    end)

    it("refuses a handle whose items do not add up", function()
        local handle = string.char(2) .. string.rep("\171", 16) .. item(500, "m", "t1")
        assert.is_nil(settle._frame(10, handle, 700))
        assert.has_error(function() settle.settle(handle, 700) end)
        assert.has_error(function() settle.settle(handle .. "x", 700) end)
    end)
end)

describe("settle: one retry", function()
    -- conn.ask answers from a script of answers, counting the sends.
    local conn = require "resty.ratelimitd.conn"
    local real_ask, real_next_id = conn.ask, conn.next_id
    local sent, answers
    before_each(function()
        sent, answers = 0, {}
        conn.next_id = function() return 1 end
        conn.ask = function()
            sent = sent + 1
            local a = answers[sent] or { decision = "allowed", count = 0 }
            if a.transport then
                return nil, a.transport
            end
            return a
        end
        _G.ngx.sleep = function() end
    end)
    after_each(function()
        conn.ask, conn.next_id = real_ask, real_next_id
    end)
    local handle = string.char(1) .. string.rep("\171", 16) .. item(500, "m", "t1")

    it("sends once more after a transport error or a retryable code, and stops there", function()
        for _, first in ipairs({ { transport = "timeout" }, { decision = "error", error = "CIRCUIT_OPEN", message = "open" },
                                 { decision = "error", error = "REDIS_TIMEOUT", message = "slow" } }) do
            sent, answers = 0, { first, { decision = "allowed", count = 7 } }
            local ok, res = settle._send(handle, 700)
            assert.is_true(ok)
            assert.equals(7, res.count)
            assert.equals(2, sent)
        end
        sent, answers = 0, { { transport = "closed" }, { transport = "closed" } }
        local ok, err = settle._send(handle, 700)
        assert.is_nil(ok)
        assert.equals("closed", err)
        assert.equals(2, sent, "one retry, not more")
    end)

    it("does not send again after an answer or an error a retry cannot mend", function()
        answers = { { decision = "error", error = "UNSUPPORTED_COMBINATION", message = "log" } }
        assert.is_nil((settle._send(handle, 700)))
        assert.equals(1, sent)
        sent, answers = 0, {}
        assert.is_true((settle._send(handle, 700)))
        assert.equals(1, sent)
    end)
end)

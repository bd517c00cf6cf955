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

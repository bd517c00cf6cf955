-- Frame encoding and response decoding against the golden hex of the
-- daemon's own tests (src/protocol/request.rs, response.rs,
-- tests/protocol.rs) and docs/PROTOCOL.md: the same bytes.

local wire = require "resty.ratelimitd.wire"

local function hex(s)
    return (s:gsub("..", function(h) return string.char(tonumber(h, 16)) end))
end

local function tohex(s)
    return (s:gsub(".", function(c) return string.format("%02x", c:byte()) end))
end

describe("wire: frames", function()
    it("encodes a CHECK as the documented bytes (section 4, 10)", function()
        local before, after, one = wire.check_parts("log", "closed", 1000, 1000, nil)
        assert.equals("0000001e01010000000700000101000003e8000003e8000000010000000000027431",
                      tohex(wire.check(7, before, after, one, 1, "t1")))
    end)

    it("encodes a cost other than 1 in the same place", function()
        local before, after, one = wire.check_parts("log", "closed", 1000, 1000, nil)
        assert.equals("0000001e01010000000700000101000003e8000003e8000000050000000000027431",
                      tohex(wire.check(7, before, after, one, 5, "t1")))
    end)

    it("puts the algorithm in flag bits 0x0F00", function()
        local before = wire.check_parts("ring", "closed", 1000, 1000, nil)
        assert.equals("0100", tohex(before:sub(1, 2)))
        before = wire.check_parts("gcra", "open", 1, 1, 9)
        assert.equals("02000001", tohex(before:sub(1, 4)))
    end)

    it("encodes a DESCRIBE_POLICY as the documented bytes (section 4g)", function()
        assert.equals("0000000e0108000000070000056f72646572", tohex(wire.describe(7, "order")))
    end)

    it("encodes a DESCRIBE_POLICY with its uses as the documented bytes (section 4g)", function()
        -- Flag 0x0001, then the uses byte: multi-item (0x02) and refundable (0x04).
        local uses = wire.USE.multi + wire.USE.refundable
        assert.equals("0000000f0108000000070001056c6f67696e06", tohex(wire.describe(7, "login", uses)))
        assert.same({ single = 1, multi = 2, refundable = 4, reserve = 8, share = 16, acquire = 32 }, wire.USE)
    end)

    it("reads a DESCRIBE_POLICY answer, and an unknown name, as documented (section 4g)", function()
        local h = hex("0000001c010800000007" .. "00ff" .. "000003e8" .. "00000064" .. "0000ea60" .. "00000200" .. "0000" .. "0000")
        assert.equals(28, wire.check_head(h, 7))
        local d = wire.description(h, "")
        assert.same({ kind = "rate", algorithm = "log", limit = 1000, window_ms = 60000, on_error = "local", local_limit = 100, shadow = false }, d)
        d = wire.description(hex("0000001c010800000009" .. "00ff" .. "00000005" .. "00000000" .. "00007530" .. "0100ff01" .. "0000" .. "0000"), "")
        assert.same({ kind = "concurrency", algorithm = "log", limit = 5, window_ms = 30000, shadow = true }, d)
        local ok, msg = wire.description(hex("00000050010800000007" .. "02ff" .. string.rep("00", 16) .. "000c" .. "0034"), "no policy of this name in the configuration in force")
        assert.equals(false, ok)
        assert.equals("no policy of this name in the configuration in force", msg)
        -- An answer of another op, or a description it cannot read: an error, never a description.
        assert.is_nil(wire.description(hex("0000001c010200000007" .. "00ff" .. string.rep("00", 20)), ""))
        assert.is_nil((wire.description(hex("0000001c010800000007" .. "00ff" .. string.rep("00", 12) .. "07000000" .. "00000000"), "")))
    end)

    it("encodes a one-item CHECK_POLICY as the documented bytes (section 4b)", function()
        local frame = wire.check_policy(7, wire.policy_header(0, "open", 1, nil), wire.policy_item(1, "\5order", "t1"))
        assert.equals("0000001c0102000000070000000100000000000000010002056f726465727431", tohex(frame))
    end)

    it("encodes a LEASE_SHARE as the documented bytes (section 4h)", function()
        local frame = wire.lease_share(7, wire.policy_header(0, "open", 1, nil), 16, "\5order", "t1")
        assert.equals("0000001c010a000000070000000100000000000000100002056f726465727431", tohex(frame))
    end)

    it("encodes an inline limit's share (CHECK with flag 0x1000) as the documented bytes (section 4h)", function()
        local _, after = wire.check_parts("log", "closed", 1000, 1000, nil)
        local frame = wire.share(7, wire.share_parts("closed", 1000, 1000), after, 64, "t1")
        assert.equals("0000001e01010000000710000101000003e8000003e8000000400000000000027431", tohex(frame))
    end)

    it("encodes a give-back (LEASE_SHARE with flag 0x0001, CHECK with 0x3000) as the documented bytes (section 4h)", function()
        local frame = wire.lease_share(7, wire.policy_header(0, "open", 1, nil), 16, "\5order", "t1", true)
        assert.equals("0000001c010a000000070001000100000000000000100002056f726465727431", tohex(frame))
        local _, after = wire.check_parts("log", "closed", 1000, 1000, nil)
        frame = wire.share(7, wire.share_parts("closed", 1000, 1000), after, 16, "t1", true)
        assert.equals("0000001e01010000000730000101000003e8000003e8000000100000000000027431", tohex(frame))
    end)

    it("encodes a refundable multi-item CHECK_POLICY as the documented bytes (section 4b)", function()
        local items = wire.policy_item(1, "\2ip", "a") .. wire.policy_item(2, "\6tenant", "t1")
        local frame = wire.check_policy(7, wire.policy_header(wire.FLAG_REFUNDABLE, "closed", 2, 0), items)
        assert.equals("000000270102000000070001010200000000000000010001026970610000000200020674656e616e747431", tohex(frame))
    end)

    it("encodes ACQUIRE_POLICY and its release as the documented bytes (section 4e)", function()
        local acquire = wire.acquire_policy(7, wire.policy_header(0, "open", 1, 0), 1, "\7uploads", "t1", "a")
        assert.equals("000000200107000000070000000100000000010000000100020775706c6f616473743161", tohex(acquire))
        local release = wire.acquire_policy(7, wire.policy_header(wire.FLAG_RELEASE, "open", 1, 0), 1, "\7uploads", "t1", "a")
        assert.equals("000000200107000000070001000100000000010000000100020775706c6f616473743161", tohex(release))
    end)

    it("encodes ACQUIRE and RELEASE with CHECK's fields, then the lease (section 4d)", function()
        local before, after = wire.check_parts("log", "closed", 10, 30000, nil)
        local frame = wire.concurrency_lease(wire.OP_ACQUIRE, 3, before, after, 1, "t1", "0123abcd")
        assert.equals(4 + 29 + 2 + 8, #frame)
        assert.equals("00000027" .. "0105" .. "00000003" .. "00000101" .. "0000000a" .. "00007530" .. "00000001" .. "00000000"
                      .. "0002" .. "08" .. tohex("t1") .. tohex("0123abcd"), tohex(frame))
    end)

    it("encodes a REFUND with the handle as given", function()
        local frame = wire.refund(9, "\1" .. string.rep("\9", 16) .. "items")
        assert.equals("0000001f" .. "0103" .. "00000009" .. "000000" .. "01" .. string.rep("09", 16) .. tohex("items"), tohex(frame))
    end)

    it("round-trips the 56-bit integers of the denial cache", function()
        for _, n in ipairs({ 0, 1, 4294967295, 4294967296, 2 ^ 52 + 3 }) do
            assert.equals(n, wire.be56(wire.u56(n), 1))
            assert.equals(7, #wire.u56(n))
        end
    end)
end)

describe("wire: responses", function()
    local documented = hex("0000001c0101000000070100000003e800000000000000fa000003e700000000")

    it("decodes the documented response (section 10)", function()
        assert.equals(28, wire.check_head(documented, 7))
        local res = wire.decode(documented, "", 1000, nil, nil)
        assert.same({
            allowed = false, decision = "denied", source = "redis", count = 1000, remaining = 0,
            retry_after_ms = 250, reset_ms = 999, error_code = 0, error = "OK", message = "", limit = 1000,
        }, res)
    end)

    it("refuses a response to another request, a bad length or unknown values", function()
        assert.same({ nil, "response out of sync" }, { wire.check_head(documented, 8) })
        assert.same({ nil, "bad response length 27" }, { wire.check_head(hex("0000001b") .. documented:sub(5), 7) })
        local bad_decision = documented:sub(1, 10) .. "\9" .. documented:sub(12)
        assert.same({ nil, "malformed response" }, { wire.check_head(bad_decision, 7) })
        local long_message = documented:sub(1, 30) .. "\0\1" -- msg_len 1 in a 28-byte frame
        assert.same({ nil, "malformed response" }, { wire.check_head(long_message, 7) })
    end)

    it("takes a policy's limit from count + remaining, and the local quota under the daemon's fallback", function()
        local res = wire.decode(documented, "", nil, nil, "order")
        assert.equals(1000, res.limit)
        assert.equals("order", res.policy)
        local from_local = documented:sub(1, 11) .. "\1" .. documented:sub(13)
        assert.equals(7, wire.decode(from_local, "", 1000, 7, nil).limit)
    end)

    it("knows error 19, UNSUPPORTED_COMBINATION", function()
        assert.equals("UNSUPPORTED_COMBINATION", wire.ERROR_NAME[19])
    end)

    it("parses the documented extension (section 5b)", function()
        local frame = hex("000000530102000000070100000000020000000000000190000003e8000000000202000000000000010000000900000000000003e800000002000003e80100000000020000000000000190000003e800000002000003e8")
        local head = frame:sub(1, 32)
        assert.equals(0x53, wire.check_head(head, 7))
        local res = wire.decode(head, "", nil, nil, "ip")
        wire.parse_extension(res, frame:sub(33), { "ip", "tenant" })
        assert.equals("tenant", res.refused)
        assert.is_false(res.handle)
        assert.same({ policy = "ip", decision = "allowed", source = "redis", count = 1, remaining = 9, retry_after_ms = 0,
                      reset_ms = 1000, limit = 2, window_ms = 1000 }, res.items[1])
        assert.equals("denied", res.items[2].decision)
        -- The refusing item is the main one: its limit and window.
        assert.equals(2, res.limit)
        assert.equals(1000, res.window_ms)
    end)
end)

-- Client keys from addresses: a client rotating inside its /64 (or the
-- configured prefix) keeps one key; mapped IPv4 is IPv4; nothing malformed
-- raises.

local client_key = require "resty.ratelimitd.client_key"

describe("client keys", function()
    local ck = assert(client_key.new())

    it("keys IPv4 by /32 and IPv6 by /64 by default", function()
        assert.equals("ip4:203.0.113.7/32", ck:key("203.0.113.7"))
        assert.equals("ip6:2001:db8:1:2::/64", ck:key("2001:db8:1:2:aaaa:bbbb:cccc:dddd"))
    end)

    it("gives every address of one /64 the same key", function()
        local want = ck:key("2001:db8:0:1::1")
        for _, a in ipairs({ "2001:db8:0:1::2", "2001:DB8:0:1:ffff:ffff:ffff:ffff", "2001:0db8:0000:0001:1234::", "[2001:db8:0:1::9]" }) do
            assert.equals(want, ck:key(a), a)
        end
        assert.are_not.equals(want, ck:key("2001:db8:0:2::1"))
    end)

    it("takes an IPv4-mapped IPv6 address as the IPv4 client", function()
        assert.equals("ip4:203.0.113.7/32", ck:key("::ffff:203.0.113.7"))
        assert.equals("ip4:203.0.113.7/32", ck:key("::FFFF:cb00:7107"))
        assert.equals("ip4:203.0.113.7/32", ck:key("0:0:0:0:0:ffff:203.0.113.7"))
    end)

    it("applies configured prefixes", function()
        local wide = assert(client_key.new({ ipv4_prefix = 24, ipv6_prefix = 48 }))
        assert.equals("ip4:203.0.113.0/24", wide:key("203.0.113.77"))
        assert.equals("ip4:203.0.113.0/24", wide:key("::ffff:203.0.113.200"))
        assert.equals("ip6:2001:db8:1::/48", wide:key("2001:db8:1:ffff::1"))
        local odd = assert(client_key.new({ ipv4_prefix = 20, ipv6_prefix = 56 }))
        assert.equals("ip4:10.1.16.0/20", odd:key("10.1.31.255"))
        assert.equals("ip6:2001:db8:1:ab00::/56", odd:key("2001:db8:1:abcd::1"))
        local exact = assert(client_key.new({ ipv6_prefix = 128 }))
        assert.equals("ip6:2001:db8:0:0:0:0:0:1/128", exact:key("2001:db8::1"))
    end)

    it("handles :: at either end and zones", function()
        assert.equals("ip6:0:0:0:0::/64", ck:key("::"))
        assert.equals("ip6:0:0:0:0::/64", ck:key("::1"))
        assert.equals("ip6:fe80:0:0:0::/64", ck:key("fe80::1%eth0"))
        assert.equals("ip6:2001:db8:0:0::/64", ck:key("2001:db8::"))
    end)

    it("gives nil and a message for malformed input, never an error", function()
        for _, bad in ipairs({ "", "1.2.3", "1.2.3.4.5", "256.1.1.1", "1.2.3.-4", "01234.1.1.1", "2001:db8::1::2", "2001:db8:1:2:3:4:5:6:7",
            "2001:db8:1:2:3:4:5", "12345::", "g::1", ":::", "1:2:3:4:5:6:7::8", "::ffff:1.2.3", "::1.2.3.4:5", "[::1", "a\0b", "\255\254",
            string.rep("1", 100), "localhost", "1.2.3.4 " }) do
            local k, err = ck:key(bad)
            assert.is_nil(k, bad)
            assert.is_string(err, bad)
            assert.is_nil(err:find("[%z\1-\31\127-\255]"), "the message carries no control or high bytes")
        end
        for _, bad in ipairs({ 42, true, {}, false }) do
            local k, err = ck:key(bad)
            assert.is_nil(k)
            assert.equals("no client address", err)
        end
    end)

    it("validates its options once, in new()", function()
        assert.same({ nil, "ipv6_prefix must be a whole number from 1 to 128, not 129" }, { client_key.new({ ipv6_prefix = 129 }) })
        assert.same({ nil, "ipv4_prefix must be a whole number from 1 to 32, not 0" }, { client_key.new({ ipv4_prefix = 0 }) })
        assert.same({ nil, "ipv4_prefix must be a whole number from 1 to 32, not 24.5" }, { client_key.new({ ipv4_prefix = 24.5 }) })
        assert.same({ nil, "client_key.new: unknown option v6" }, { client_key.new({ v6 = 64 }) })
        assert.same({ nil, "client_key.new takes a table of options" }, { client_key.new("64") })
    end)
end)

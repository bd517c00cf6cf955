-- Client keys from addresses: a client rotating inside its /64 (or the
-- configured prefix) keeps one key; mapped IPv4 is IPv4; nothing malformed
-- raises.

local client_key = require "resty.ratelimitd.client_key"

describe("client keys", function()
    local ck = assert(client_key.new())

    -- Each { key, address } pair: the key `keys` (ck by default) gives the address.
    local function keys_as(pairs_, keys)
        for _, p in ipairs(pairs_) do
            assert.equals(p[1], (keys or ck):key(p[2]), p[2])
        end
    end

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
        for _, a in ipairs({ "::ffff:203.0.113.7", "::FFFF:cb00:7107", "0:0:0:0:0:ffff:203.0.113.7" }) do
            assert.equals("ip4:203.0.113.7/32", ck:key(a), a)
        end
    end)

    it("takes the IPv6 forms that embed an IPv4 address as that IPv4 client", function()
        keys_as({
            -- RFC 6052's well-known NAT64 prefix 64:ff9b::/96 (NAT64, SIIT, SIIT-DC).
            { "ip4:203.0.113.7/32", "64:ff9b::203.0.113.7" },
            { "ip4:203.0.113.7/32", "64:ff9b::cb00:7107" },
            { "ip4:198.51.100.1/32", "64:FF9B:0:0:0:0:c633:6401" },
            -- IPv4-translated (RFC 2765, SIIT): ::ffff:0:a.b.c.d.
            { "ip4:203.0.113.7/32", "::ffff:0:203.0.113.7" },
            { "ip4:203.0.113.7/32", "0:0:0:0:ffff:0:cb00:7107" },
            -- IPv4-compatible (RFC 4291, deprecated): ::a.b.c.d; :: and ::1 stay IPv6.
            { "ip4:203.0.113.7/32", "::203.0.113.7" },
            { "ip4:0.0.0.2/32", "::2" },
            -- Teredo (RFC 4380): 2001:0::/32, the client's public IPv4 in the
            -- last 32 bits, each bit inverted: two clients of one relay differ.
            { "ip4:192.0.2.45/32", "2001:0:4136:e378:8000:63bf:3fff:fdd2" },
            { "ip4:192.0.2.46/32", "2001:0:4136:e378:8000:63bf:3fff:fdd1" },
            { "ip4:192.0.2.45/32", "2001::ffff:3fff:fdd2" },
            -- 6to4 (RFC 3056): 2002:V4ADDR::/48, one IPv4 host's.
            { "ip4:192.0.2.45/32", "2002:c000:22d:1::1" },
            { "ip4:192.0.2.45/32", "2002:c000:22d:ffff::1" },
        })
        -- The configured IPv4 prefix applies to all of them.
        keys_as({
            { "ip4:203.0.113.0/24", "64:ff9b::203.0.113.250" },
            { "ip4:192.0.2.0/24", "2001:0:4136:e378:8000:63bf:3fff:fdd2" },
        }, assert(client_key.new({ ipv4_prefix = 24 })))
        -- Next to them, other IPv6 addresses keep their /64
        -- (64:ff9b:1::/48 is RFC 8215's local-use prefix: where the IPv4
        -- sits is the operator's choice).
        keys_as({
            { "ip6:64:ff9a:0:0::/64", "64:ff9a::203.0.113.7" },
            { "ip6:64:ff9b:1:0::/64", "64:ff9b:1::203.0.113.7" },
            { "ip6:2001:1:0:0::/64", "2001:1::1" },
            { "ip6:2001:db8:0:0::/64", "2001:db8::203.0.113.7" },
            { "ip6:0:0:0:0::/64", "::ffff:1:203.0.113.7" },
        })
    end)

    it("applies configured prefixes", function()
        keys_as({
            { "ip4:203.0.113.0/24", "203.0.113.77" },
            { "ip4:203.0.113.0/24", "::ffff:203.0.113.200" },
            { "ip6:2001:db8:1::/48", "2001:db8:1:ffff::1" },
        }, assert(client_key.new({ ipv4_prefix = 24, ipv6_prefix = 48 })))
        keys_as({
            { "ip4:10.1.16.0/20", "10.1.31.255" },
            { "ip6:2001:db8:1:ab00::/56", "2001:db8:1:abcd::1" },
        }, assert(client_key.new({ ipv4_prefix = 20, ipv6_prefix = 56 })))
        keys_as({ { "ip6:2001:db8:0:0:0:0:0:1/128", "2001:db8::1" } }, assert(client_key.new({ ipv6_prefix = 128 })))
    end)

    it("handles :: at either end and zones", function()
        keys_as({
            { "ip6:0:0:0:0::/64", "::" },
            { "ip6:0:0:0:0::/64", "::1" },
            { "ip6:fe80:0:0:0::/64", "fe80::1%eth0" },
            { "ip6:2001:db8:0:0::/64", "2001:db8::" },
        })
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

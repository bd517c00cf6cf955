-- resty.ratelimitd.client_key: the client's address as a key that one
-- client cannot dodge by changing address inside its own network: IPv4 by
-- /32 (or a configured prefix), IPv6 by /64 (or a configured prefix: one
-- subscriber usually gets a /64 or more, and can rotate through all of it).
-- An IPv6 address that embeds an IPv4 client is that IPv4 client: mapped
-- (::ffff:203.0.113.7, what a dual-stack socket reports for an IPv4
-- client), IPv4-translated, NAT64/SIIT's 64:ff9b::/96 (RFC 6052),
-- IPv4-compatible, Teredo (RFC 4380) and 6to4 (`embedded_v4` below,
-- docs/NGINX.md).
--
-- Behind proxies, nginx's realip module (set_real_ip_from the trusted
-- proxies, real_ip_header X-Forwarded-For, real_ip_recursive on) makes
-- $remote_addr the real client; this module reads $remote_addr, so a
-- client can forge nothing past the trusted proxies. Never read
-- X-Forwarded-For here yourself: its leftmost entry is the client's choice.
--
--   local client_key = require "resty.ratelimitd.client_key"
--   local by_net = assert(client_key.new{ ipv4_prefix = 32, ipv6_prefix = 64 })  -- once, at init
--   local key, err = by_net:key()            -- ngx.var.remote_addr
--   local key, err = by_net:key("2001:db8::1")  -- "ip6:2001:db8:0:0::/64"
--
-- Keys: "ip4:A.B.C.D/N" and "ip6:G1:...:Gk::/N" (the first ceil(N/16)
-- groups, masked, in lowercase hex without leading zeros; no "::" at /128).
-- A malformed address (or none) gives nil and a message: never an error.

local byte, sub, find, gsub, lower, fmt = string.byte, string.sub, string.find, string.gsub, string.lower, string.format
local tonumber, type, floor, concat = tonumber, type, math.floor, table.concat

local _M = { _VERSION = "0.1.0" }
local mt = { __index = _M }

local MAX_LEN = 64 -- longer than any textual address (45 bytes + a zone)

-- `n` keeping its high `keep` bits of `width`.
local function mask(n, width, keep)
    if keep >= width then
        return n
    end
    if keep <= 0 then
        return 0
    end
    local unit = 2 ^ (width - keep)
    return floor(n / unit) * unit
end

-- The four octets of a dotted quad, or nil.
local function parse_v4(s)
    local a, b, c, d = s:match("^(%d%d?%d?)%.(%d%d?%d?)%.(%d%d?%d?)%.(%d%d?%d?)$")
    if not a then
        return nil
    end
    local o = { tonumber(a), tonumber(b), tonumber(c), tonumber(d) }
    for i = 1, 4 do
        if o[i] > 255 then
            return nil
        end
    end
    return o
end

-- The hex groups of one side of "::" (may end in a dotted quad), or nil.
local function groups_of(part, out, last)
    if part == "" then
        return out
    end
    local fields = {}
    for field in (part .. ":"):gmatch("([^:]*):") do
        fields[#fields + 1] = field
    end
    for i, field in ipairs(fields) do
        if last and i == #fields and find(field, ".", 1, true) then
            local o = parse_v4(field)
            if not o then
                return nil
            end
            out[#out + 1] = o[1] * 256 + o[2]
            out[#out + 1] = o[3] * 256 + o[4]
        else
            if not field:match("^%x%x?%x?%x?$") then
                return nil
            end
            out[#out + 1] = tonumber(field, 16)
        end
    end
    return out
end

-- The eight 16-bit groups of an IPv6 address, or nil.
local function parse_v6(s)
    local pct = find(s, "%", 1, true)
    if pct then
        s = sub(s, 1, pct - 1) -- a zone (fe80::1%eth0) names a link, not a client
    end
    local head, tail = s, nil
    local dc = find(s, "::", 1, true)
    if dc then
        head, tail = sub(s, 1, dc - 1), sub(s, dc + 2)
        if find(tail, "::", 1, true) then
            return nil
        end
    end
    local left = groups_of(head, {}, tail == nil)
    if not left then
        return nil
    end
    if not tail then
        return #left == 8 and left or nil
    end
    local right = groups_of(tail, {}, true)
    if not right or #left + #right > 7 then
        return nil
    end
    for _ = 1, 8 - #left - #right do
        left[#left + 1] = 0
    end
    for i = 1, #right do
        left[#left + 1] = right[i]
    end
    return left
end

local function check_prefix(name, v, default, width)
    if v == nil then
        return default
    end
    if type(v) ~= "number" or v ~= floor(v) or v < 1 or v > width then
        return nil, fmt("%s must be a whole number from 1 to %d, not %s", name, width, tostring(v))
    end
    return v
end

-- opts: ipv4_prefix (1..32, default 32), ipv6_prefix (1..128, default 64).
function _M.new(opts)
    opts = opts or {}
    if type(opts) ~= "table" then
        return nil, "client_key.new takes a table of options"
    end
    for k in pairs(opts) do
        if k ~= "ipv4_prefix" and k ~= "ipv6_prefix" then
            return nil, "client_key.new: unknown option " .. tostring(k)
        end
    end
    local v4, err = check_prefix("ipv4_prefix", opts.ipv4_prefix, 32, 32)
    if not v4 then
        return nil, err
    end
    local v6, err6 = check_prefix("ipv6_prefix", opts.ipv6_prefix, 64, 128)
    if not v6 then
        return nil, err6
    end
    return setmetatable({ v4 = v4, v6 = v6 }, mt)
end

local function v4_key(self, o)
    local keep, out = self.v4, {}
    for i = 1, 4 do
        out[i] = mask(o[i], 8, keep - (i - 1) * 8)
    end
    return fmt("ip4:%d.%d.%d.%d/%d", out[1], out[2], out[3], out[4], keep)
end

-- The octets of the 32 bits `hi`, `lo` (two groups), each bit inverted
-- when `invert`.
local function octets(hi, lo, invert)
    if invert then
        hi, lo = 0xffff - hi, 0xffff - lo
    end
    return { floor(hi / 256), hi % 256, floor(lo / 256), lo % 256 }
end

-- The IPv4 client an IPv6 address stands for, or nil: each range below
-- holds one IPv4 host's traffic in a single address (or one /48), so keyed
-- by its /64 every IPv4 client behind one translator would share a limit
-- (or one 6to4 host rotate through 65,536 of them).
--   ::ffff:a.b.c.d        IPv4-mapped (a dual-stack socket's IPv4 client)
--   ::ffff:0:a.b.c.d      IPv4-translated (RFC 2765, SIIT)
--   64:ff9b::a.b.c.d      RFC 6052's well-known prefix (NAT64, SIIT-DC);
--                         a network-specific prefix (RFC 8215's
--                         64:ff9b:1::/48 included) puts the IPv4 where its
--                         operator chose, and stays an IPv6 /64 here
--   ::a.b.c.d             IPv4-compatible (RFC 4291, deprecated); :: and
--                         ::1 (unspecified, loopback) stay IPv6
--   2001:0::/32           Teredo (RFC 4380): the client's public IPv4 (its
--                         NAT's) in the last 32 bits, each bit inverted;
--                         by /64 every client of one Teredo server shares
--   2002:V4ADDR::/48      6to4 (RFC 3056): the host's IPv4 in bits 16-47
local function embedded_v4(g)
    local zero64 = g[1] == 0 and g[2] == 0 and g[3] == 0 and g[4] == 0
    if zero64 and g[5] == 0 then
        if g[6] == 0xffff then
            return octets(g[7], g[8])
        end
        if g[6] == 0 and (g[7] ~= 0 or g[8] > 1) then
            return octets(g[7], g[8])
        end
        return nil
    end
    if zero64 and g[5] == 0xffff and g[6] == 0 then
        return octets(g[7], g[8])
    end
    if g[1] == 0x64 and g[2] == 0xff9b and g[3] == 0 and g[4] == 0 and g[5] == 0 and g[6] == 0 then
        return octets(g[7], g[8])
    end
    if g[1] == 0x2001 and g[2] == 0 then
        return octets(g[7], g[8], true)
    end
    if g[1] == 0x2002 then
        return octets(g[2], g[3])
    end
    return nil
end

-- The key of `addr` (default: ngx.var.remote_addr), or nil and a message.
function _M.key(self, addr)
    if addr == nil and ngx and ngx.var then
        addr = ngx.var.remote_addr
    end
    if type(addr) ~= "string" or addr == "" then
        return nil, "no client address"
    end
    if #addr > MAX_LEN then
        return nil, "not an IP address (too long)"
    end
    if byte(addr, 1) == 91 then -- "[2001:db8::1]"
        addr = addr:match("^%[(.*)%]$") or ""
    end
    local o = parse_v4(addr)
    if o then
        return v4_key(self, o)
    end
    local g = parse_v6(lower(addr))
    if not g then
        return nil, "not an IP address: " .. gsub(addr, "[%c\127-\255]", "?")
    end
    local v4 = embedded_v4(g)
    if v4 then
        return v4_key(self, v4)
    end
    local keep = self.v6
    local n = math.ceil(keep / 16)
    local out = {}
    for i = 1, n do
        out[i] = fmt("%x", mask(g[i], 16, keep - (i - 1) * 16))
    end
    if n == 8 then
        return "ip6:" .. concat(out, ":") .. "/" .. keep
    end
    return "ip6:" .. concat(out, ":") .. "::/" .. keep
end

return _M

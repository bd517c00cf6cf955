-- What a key from request data is sent as (resty/ratelimitd/kind.lua):
-- nothing a client sends raises,
-- and nothing it sends reaches the daemon or a log line raw when it is
-- empty, too long or holds control bytes.

-- kind.lua reads ngx.md5 when loaded: a stand-in that names its input.
-- Its neighbours read ngx.socket.tcp (conn.lua) and resty.core's request
-- getter (request.lua) when loaded: stand-ins, as request_spec.lua makes
-- them; nothing here calls them.
rawset(_G, "ngx", rawget(_G, "ngx") or {})
rawset(ngx, "md5", function(s) return "h(" .. s .. ")" end)
rawset(ngx, "socket", ngx.socket or { tcp = function() end })
package.loaded["resty.core.base"] = package.loaded["resty.core.base"] or { get_request = function() return nil end }

local kind = require "resty.ratelimitd.kind"
-- The key rules under the names the assertions use.
local key = { wire = kind.wire_key, args = kind.key_args }
local settings = require("resty.ratelimitd.config").settings

describe("keys", function()
    it("sends a plain key as it is", function()
        assert.equals("tenant-a", key.wire("tenant-a"))
        assert.equals("utf8-ключ", key.wire("utf8-ключ"))
    end)

    it("hashes an empty key, an absent header's nil, and a key with control bytes", function()
        assert.equals("md5:h()", key.wire(""))
        assert.equals("md5:h()", key.wire(nil))
        assert.equals("md5:h(a\tb)", key.wire("a\tb"))
        assert.equals("md5:h(a\0b)", key.wire("a\0b"))
        assert.equals("md5:h(a\31b)", key.wire("a\31b"), "0x1F: the daemon's shard separator (SEMANTICS S2)")
        assert.equals("md5:h(a\127b)", key.wire("a\127b"))
        assert.equals("a\32b\128\255", key.wire("a\32b\128\255"), "space and bytes above 0x7f are not control bytes")
    end)

    it("hashes a key longer than max_key_len", function()
        local long = string.rep("x", settings.max_key_len + 1)
        assert.equals("md5:h(" .. long .. ")", key.wire(long))
        assert.equals(string.rep("x", settings.max_key_len), key.wire(string.rep("x", settings.max_key_len)))
    end)

    it("hashes a key that begins with the hashed keys' md5: so no key a client sends can be another's hash", function()
        -- A 600-byte tenant id is sent as md5:<its hash>; a client sending
        -- that text literally must not spend the tenant's window, nor one
        -- sending md5:<hash of ""> every keyless request's.
        local long = string.rep("t", 600)
        local literal = key.wire(long)
        assert.equals("md5:h(" .. long .. ")", literal)
        assert.equals("md5:h(" .. literal .. ")", key.wire(literal))
        local hex = "md5:0123456789abcdef0123456789abcdef" -- what ngx.md5 gives, sent literally
        assert.equals("md5:h(" .. hex .. ")", key.wire(hex))
        assert.are_not.equals(key.wire(""), key.wire(key.wire("")))
        assert.equals("md5:h(md5:)", key.wire("md5:"))
        assert.equals("md5:h(md5:x)", key.wire({ "md5:x" }), "a repeated header's joined values too")
        -- Only that exact prefix: other keys are sent as they are.
        assert.equals("md5", key.wire("md5"))
        assert.equals("MD5:x", key.wire("MD5:x"))
        assert.equals("tenant:md5:x", key.wire("tenant:md5:x"))
    end)

    it("takes a number and a repeated header's list of values", function()
        assert.equals("42", key.wire(42))
        assert.equals("a, b", key.wire({ "a", "b" }))
    end)

    it("gives nil and a message for a key no request can make", function()
        assert.same({ nil, "key must be a string (or nil, a number, a list of strings), not a boolean" }, { key.wire(true) })
        assert.is_nil(key.wire({ {} }))
    end)
end)

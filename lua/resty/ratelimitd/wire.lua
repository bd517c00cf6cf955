-- resty.ratelimitd.wire: the daemon's binary protocol (docs/PROTOCOL.md):
-- the codes tables, frame encoding, response decoding. Pure Lua (LuaJIT's
-- bit library only): no ngx, no I/O, so the Lua unit tests run it as is.

local bit = require "bit"

local band, rshift = bit.band, bit.rshift
local byte, char, sub = string.byte, string.char, string.sub
local floor = math.floor
local concat = table.concat
local tostring, ipairs, pairs = tostring, ipairs, pairs

local _M = {}

local VERSION = 1
_M.VERSION = VERSION
_M.OP_CHECK, _M.OP_CHECK_POLICY, _M.OP_REFUND = 1, 2, 3
_M.OP_ACQUIRE, _M.OP_RELEASE = 5, 6
-- ACQUIRE_POLICY (section 4e): a lease of a named concurrency policy; with
-- the flag 0x0001, its release.
_M.OP_ACQUIRE_POLICY, _M.FLAG_RELEASE = 7, 1
-- DESCRIBE_POLICY (section 4g): what the daemon's configuration says of a
-- policy name; the answer is in the response's fixed fields.
_M.OP_DESCRIBE_POLICY = 8
-- DESCRIBE_POLICY's flag 0x0001: a uses byte follows the name, one bit per
-- way a limiter uses the policy (a reload refuses to make one impossible).
_M.FLAG_DESCRIBE_USES = 1
_M.USE = { single = 0x01, multi = 0x02, refundable = 0x04, reserve = 0x08, share = 0x10, acquire = 0x20 }
_M.FLAG_REFUNDABLE = 1
-- CHECK_POLICY flag 0x0002: the check reserves its cost (section 4f).
_M.FLAG_SETTLE = 2
_M.MAX_POLICY_ITEMS = 8
_M.MAX_POLICY_NAME_LEN = 31
_M.UNKNOWN_POLICY = 12
local RESPONSE_FIXED_LEN = 28
_M.RESPONSE_FIXED_LEN = RESPONSE_FIXED_LEN
-- The message, then (multi-item or refundable checks, PROTOCOL.md 5b) the
-- extension: 3 bytes, a 16-byte handle and 26 bytes per item.
_M.MAX_RESPONSE_LEN = RESPONSE_FIXED_LEN + 512 + 3 + 16 + _M.MAX_POLICY_ITEMS * 26
-- The length prefix and the fixed fields: read in one receive (a message
-- follows only with an error code, and is read by a second one).
_M.RESPONSE_HEAD_LEN = 4 + RESPONSE_FIXED_LEN

-- The vocabulary (tests/vocabulary.rs holds these tables to the daemon's).
local POLICY = { open = 0, closed = 1, ["local"] = 2 }
-- How a limit counts (docs/ALGORITHMS.md); sent in the CHECK flags' bits
-- 0x0F00 (the first flags byte), 0 (the log) when not chosen.
local ALGORITHM = { log = 0, ring = 1, gcra = 2, sliding_counter = 3, fixed = 4 }
local DECISION = { [0] = "allowed", [1] = "denied", [2] = "error", [3] = "shadow_denied", [4] = "shadow_allowed" }
local SOURCE = { [0] = "redis", [1] = "local", [2] = "fail_open", [3] = "fail_closed", [4] = "memory", [5] = "denial_cache", [6] = "exempt", [255] = "none" }
local ERROR_NAME = {
    [0] = "OK", [1] = "MALFORMED", [2] = "UNSUPPORTED_VERSION", [3] = "UNKNOWN_OP",
    [4] = "UNSUPPORTED_FLAGS", [5] = "UNSUPPORTED_LIMIT_COUNT", [6] = "INVALID_KEY",
    [7] = "INVALID_LIMIT", [8] = "INVALID_WINDOW", [9] = "INVALID_COST", [10] = "INVALID_POLICY",
    [11] = "INVALID_LOCAL_LIMIT", [12] = "UNKNOWN_POLICY", [13] = "DUPLICATE_ITEM",
    [14] = "REFUND_UNSUPPORTED", [16] = "UNKNOWN_ALGORITHM", [17] = "INVALID_LEASE",
    [18] = "WRONG_POLICY_KIND", [19] = "UNSUPPORTED_COMBINATION",
    [20] = "FRAME_TOO_LARGE", [30] = "REDIS_TIMEOUT",
    [31] = "REDIS_UNAVAILABLE", [32] = "REDIS_ERROR", [33] = "CIRCUIT_OPEN", [34] = "LOCAL_CAPACITY",
    [35] = "OVERLOADED",
}
_M.POLICY, _M.ALGORITHM, _M.DECISION, _M.SOURCE, _M.ERROR_NAME = POLICY, ALGORITHM, DECISION, SOURCE, ERROR_NAME

-- Sources whose numbers the daemon counted: a policy's limit for the key
-- (its override included) is count + remaining.
local DAEMON_COUNTED = { redis = true, memory = true, denial_cache = true, ["local"] = true }

local function u32(n)
    return char(band(rshift(n, 24), 255), band(rshift(n, 16), 255), band(rshift(n, 8), 255), band(n, 255))
end

local function be32(s, at)
    local a, b, c, d = byte(s, at, at + 3)
    return ((a * 256 + b) * 256 + c) * 256 + d
end

local function be16(s, at)
    local a, b = byte(s, at, at + 1)
    return a * 256 + b
end

-- 56-bit big-endian integers (µs of the monotonic clock; exact below 2^53).
local function u56(n)
    local hi = floor(n / 4294967296)
    return char(band(rshift(hi, 16), 255), band(rshift(hi, 8), 255), band(hi, 255)) .. u32(n - hi * 4294967296)
end

local function be56(s, at)
    local a, b, c = byte(s, at, at + 2)
    return ((a * 256 + b) * 256 + c) * 4294967296 + be32(s, at + 3)
end

_M.u32, _M.be32, _M.be16, _M.u56, _M.be56 = u32, be32, be16, u56, be56

-- Length, version, op and id: the first 10 bytes of every frame, in one
-- string.
local function head(len, op, id)
    return char(band(rshift(len, 24), 255), band(rshift(len, 16), 255), band(rshift(len, 8), 255), band(len, 255),
                VERSION, op,
                band(rshift(id, 24), 255), band(rshift(id, 16), 255), band(rshift(id, 8), 255), band(id, 255))
end

local function key_len(n)
    return char(band(rshift(n, 8), 255), band(n, 255))
end

local COST_ONE = u32(1)

-- The constant parts of a CHECK (section 4) around its cost: flags (the
-- algorithm), policy, n_limits (1), limit, window_ms | cost | local_limit.
-- Built once per limiter; `one` is the whole of them for a cost of 1.
function _M.check_parts(algorithm, on_error, limit, window_ms, local_limit)
    local before = char(ALGORITHM[algorithm], 0, POLICY[on_error], 1) .. u32(limit) .. u32(window_ms)
    local after = u32(local_limit or 0)
    return before, after, before .. COST_ONE .. after
end

-- CHECK of `key` (a wire key); `parts` from check_parts. Per request only
-- the length, the id, the cost and the key are encoded, in one
-- concatenation: for four short pieces sock:send(table) walks the table
-- three times through the C API, which measured no cheaper (docs/NGINX.md).
function _M.check(id, before, after, one, cost, key)
    local n = #key
    if cost == 1 then
        return head(28 + n, 1, id) .. one .. key_len(n) .. key
    end
    return head(28 + n, 1, id) .. before .. u32(cost) .. after .. key_len(n) .. key
end

--- The constant part of an inline limit's share request (CHECK with the
-- share flag 0x1000, the log algorithm) before the units: share() below.
function _M.share_parts(on_error, limit, window_ms)
    return char(0x10, 0, POLICY[on_error], 1) .. u32(limit) .. u32(window_ms)
end

--- CHECK with the share flag (section 4h): `units` of the daemon's lease
-- on an inline limit's key for this host's workers; with `back`, the
-- give-back flag too (0x3000): `units` unused, given back.
function _M.share(id, before, after, units, key, back)
    local n = #key
    if back then
        before = char(0x30) .. sub(before, 2)
    end
    return head(28 + n, 1, id) .. before .. u32(units) .. after .. key_len(n) .. key
end

-- ACQUIRE / RELEASE (section 4d) of a concurrency lease: CHECK's fields
-- (the lease length as window_ms), then the lease id's length, the key and
-- the lease id.
function _M.concurrency_lease(op, id, before, after, cost, key, lease_id)
    local n = #key
    return head(29 + n + #lease_id, op, id) .. before .. u32(cost) .. after .. key_len(n) .. char(#lease_id) .. key .. lease_id
end

-- The constant header of a CHECK_POLICY (section 4b) after the id: flags,
-- fail policy, n_items, local_limit.
function _M.policy_header(flags, on_error, n_items, local_limit)
    return char(0, flags, POLICY[on_error], n_items) .. u32(local_limit or 0)
end

-- One item of a CHECK_POLICY: cost, key_len, name_len, name, key.
-- `name_part` is the name's length byte and the name.
function _M.policy_item(cost, name_part, key)
    local n = #key
    return u32(cost) .. key_len(n) .. name_part .. key
end

-- CHECK_POLICY of `items` (their concatenation, n_items in `header`).
function _M.check_policy(id, header, items)
    return head(14 + #items, 2, id) .. header .. items
end

-- ACQUIRE_POLICY (section 4e): CHECK_POLICY's header (the release flag in
-- it), the lease id's length, the item, then the lease id.
function _M.acquire_policy(id, header, cost, name_part, key, lease)
    local item = _M.policy_item(cost, name_part, key)
    return head(15 + #item + #lease, 7, id) .. header .. char(#lease) .. item .. lease
end

-- LEASE_SHARE (op 10, section 4h): CHECK_POLICY's header and one item
-- whose cost is the units wanted (share.lua).
_M.OP_LEASE_SHARE = 10
function _M.lease_share(id, header, units, name_part, key, back)
    local item = _M.policy_item(units, name_part, key)
    if back then
        -- Flag 0x0001: `units` unused, given back.
        header = char(0, 1) .. sub(header, 3)
    end
    return head(14 + #item, 10, id) .. header .. item
end

-- REFUND (section 4c): version, op, id, flags (0), a reserved byte, then
-- the handle (item count, the 16 bytes of the daemon's handle, the items).
function _M.refund(id, handle)
    local body = char(VERSION, 3) .. u32(id) .. char(0, 0, 0) .. handle
    return u32(#body) .. body
end

-- SETTLE (op 9, section 4f): version, op, id, flags (0), a reserved byte,
-- the reserve's handle (item count, the daemon's 16 bytes), then each item
-- of the reserve (cost u32, key length u16, name length u8, name, key) as
-- the handle holds it with its cost replaced by `actual`; nil when the
-- handle's items do not add up (not a reserve's handle).
_M.OP_SETTLE = 9
function _M.settle(id, handle, actual)
    local cost = u32(actual)
    local parts = { char(VERSION, 9), u32(id), char(0, 0, 0), sub(handle, 1, 17) }
    local at = 18
    for _ = 1, byte(handle, 1) do
        local k1, k2, name_len = byte(handle, at + 4, at + 6)
        if not name_len then
            return nil
        end
        local stop = at + 7 + name_len + k1 * 256 + k2
        if stop - 1 > #handle then
            return nil
        end
        parts[#parts + 1] = cost
        parts[#parts + 1] = sub(handle, at + 4, stop - 1)
        at = stop
    end
    if at ~= #handle + 1 then
        return nil
    end
    local body = concat(parts)
    return u32(#body) .. body
end

-- DESCRIBE_POLICY of `name`: version, op, id, flags, the name's length
-- and the name; with `uses` (a sum of USE bits), flag 0x0001 and the uses
-- byte after the name (without: a daemon takes it for a single check).
function _M.describe(id, name, uses)
    if not uses then
        return head(9 + #name, 8, id) .. char(0, 0, #name) .. name
    end
    return head(10 + #name, 8, id) .. char(0, _M.FLAG_DESCRIBE_USES, #name) .. name .. char(uses)
end

local KIND = { [0] = "rate", [1] = "concurrency" }
local ALGORITHM_NAME = {}
for name, v in pairs(ALGORITHM) do
    ALGORITHM_NAME[v] = name
end
local ON_ERROR_NAME = { [0] = "open", [1] = "closed", [2] = "local" }

-- The answer to a DESCRIBE_POLICY (`h` as check_head accepted it): a table
-- { kind, algorithm, limit, window_ms, on_error (nil: the location's),
-- local_limit (nil: none), shadow }; false and the daemon's message for a
-- name it does not have; nil and an error for any other answer.
function _M.description(h, message)
    local code = be16(h, 29)
    if code == _M.UNKNOWN_POLICY then
        return false, message
    end
    if byte(h, 6) ~= 8 or byte(h, 11) ~= 0 or code ~= 0 then
        return nil, (ERROR_NAME[code] or tostring(code)) .. ": " .. (message or "")
    end
    -- reset_ms's four bytes: kind, algorithm, on_error (255: none), flags.
    local kind, algorithm, on_error, flags = byte(h, 25, 28)
    if not KIND[kind] or not ALGORITHM_NAME[algorithm] or (on_error ~= 255 and not ON_ERROR_NAME[on_error]) then
        return nil, "malformed description"
    end
    local local_limit = be32(h, 17)
    return {
        kind = KIND[kind],
        algorithm = ALGORITHM_NAME[algorithm],
        limit = be32(h, 13),
        window_ms = be32(h, 21),
        on_error = ON_ERROR_NAME[on_error],
        local_limit = local_limit > 0 and local_limit or nil,
        shadow = band(flags, 1) == 1,
    }
end

-- Checks the length prefix and the fixed fields of a response (`h`, 32
-- bytes) to request `id`: the frame's length after the prefix, or nil and
-- why it cannot be read.
function _M.check_head(h, id)
    local len = be32(h, 1)
    if len < RESPONSE_FIXED_LEN or len > _M.MAX_RESPONSE_LEN then
        return nil, "bad response length " .. len
    end
    if byte(h, 5) ~= VERSION or be32(h, 7) ~= id then
        return nil, "response out of sync"
    end
    if RESPONSE_FIXED_LEN + be16(h, 31) > len or not DECISION[byte(h, 11)] or not SOURCE[byte(h, 12)] then
        return nil, "malformed response"
    end
    return len
end

-- The units of a share granted in the answer to a LEASE_SHARE or a CHECK
-- with the share flag (section 4h; `h` as check_head accepted it): units,
-- the key's count outside the lease, the share's validity (ms) and the
-- window (flags for the response's numbers), in the fields count,
-- remaining, retry_after_ms and reset_ms. Zeros for an error answer.
function _M.share_grant(h)
    if be16(h, 29) ~= 0 then
        return 0, 0, 0, 0
    end
    return be32(h, 13), be32(h, 17), be32(h, 21), be32(h, 25)
end

function _M.message_len(h)
    return be16(h, 31)
end

function _M.error_code(h)
    return be16(h, 29)
end

-- The decision table of a response: `h` its prefix and fixed fields, as
-- check_head accepted them. `limit` is the limiter's own (nil for a
-- policy's), `local_limit` its fallback quota, `policy` its policy's name.
-- Made with every field it will hold, so it is never resized.
function _M.decode(h, message, limit, local_limit, policy)
    -- Offsets in `h` are the body's plus the 4 bytes of length prefix.
    local code = be16(h, 29)
    local source = SOURCE[byte(h, 12)]
    local decision = DECISION[byte(h, 11)]
    local count, remaining = be32(h, 13), be32(h, 17)
    if source == "local" then
        -- The daemon's local fallback counts against the local quota.
        limit = local_limit
    end
    if policy then
        -- The policy's limit for this key (its override included) is the
        -- daemon's: count plus remaining, whenever something was counted.
        limit = DAEMON_COUNTED[source] and count + remaining or nil
    end
    return {
        -- A shadow policy's decision is reported, never enforced.
        allowed = decision == "allowed" or decision == "shadow_denied" or decision == "shadow_allowed",
        decision = decision,
        source = source,
        count = count,
        remaining = remaining,
        retry_after_ms = be32(h, 21),
        reset_ms = be32(h, 25),
        error_code = code,
        error = ERROR_NAME[code] or tostring(code),
        message = message,
        limit = limit,
        policy = policy,
    }
end

-- The item the legacy fields (and res.limit, res.window_ms) show: the first
-- refusing item, else the most constrained one that counted. Shadow items
-- (decided shadow_denied or shadow_allowed by the daemon, or named in
-- `hidden` for a daemon older than shadow_allowed) are never shown.
function _M.main_item(items, hidden)
    local main
    for _, it in ipairs(items) do
        if not (hidden and hidden[it.policy]) then
            if it.decision == "denied" and it.source ~= "none" then
                return it
            end
            if it.decision == "allowed" and it.source ~= "exempt" and (not main or it.remaining < main.remaining) then
                main = it
            end
        end
    end
    return main
end

-- Fills res.items (one table per policy: policy, decision, source, count,
-- remaining, retry_after_ms, reset_ms, limit, window_ms), res.refused (the
-- name of the policy that refused) and res.handle (16 bytes, or false) from
-- the extension of section 5b. `names`: the policies in request order.
function _M.parse_extension(res, ext, names, hidden)
    local n, refused, handle_len = byte(ext, 1, 3)
    local items = {}
    local at = 4 + handle_len
    for i = 1, n do
        items[i] = {
            policy = names[i],
            decision = DECISION[byte(ext, at)] or "error",
            source = SOURCE[byte(ext, at + 1)] or "none",
            count = be32(ext, at + 2),
            remaining = be32(ext, at + 6),
            retry_after_ms = be32(ext, at + 10),
            reset_ms = be32(ext, at + 14),
            limit = be32(ext, at + 18),
            window_ms = be32(ext, at + 22),
        }
        at = at + 26
    end
    res.items = items
    res.refused = refused > 0 and names[refused] or false
    res.handle = handle_len > 0 and sub(ext, 4, 3 + handle_len) or false
    res.policy = res.refused or names[1]
    local main = _M.main_item(items, hidden)
    res.limit = main and main.limit > 0 and main.limit or nil
    res.window_ms = main and main.window_ms or nil
end

return _M

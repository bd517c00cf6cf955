-- resty.ratelimitd.policy: a limiter of one named policy (CHECK_POLICY of
-- one item): the daemon holds its limit, window, algorithm, overrides and
-- allowlist (docs/POLICIES.md); the frame carries the name, the key and
-- the cost. The location's on_error decides when the daemon gives no
-- decision, and when the name is unknown to it. With on_error = "local",
-- local_limit is the per-host quota and window_ms the window of this
-- client's own fallback (the daemon's fallback uses the policy's window).
-- No denial cache here: it is keyed by limit and window, which the daemon
-- holds and a reload may change; the daemon's own cache applies.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local fallback = require "resty.ratelimitd.fallback"
local options = require "resty.ratelimitd.options"
local http = require "resty.ratelimitd.http"
local wire_key = require("resty.ratelimitd.key").wire

local char = string.char
local floor = math.floor
local type, error, setmetatable, getmetatable = type, error, setmetatable, getmetatable
local next_id, transact, decode = conn.next_id, conn.transact, wire.decode
local check_policy, policy_item = wire.check_policy, wire.policy_item

local _M = {}

local Policy = {}
local mt = { __index = Policy }

function Policy._decide(self, key, cost)
    local id = next_id()
    local head, message = transact(check_policy(id, self._header, policy_item(cost, self._name_part, key)), id)
    if not head then
        return nil, message
    end
    return decode(head, message, nil, self._local_limit, self._policy)
end

Policy._fallback = fallback.one

function Policy._label(_, key)
    return key
end

-- Per-request arguments, raised at the caller's line when they are a bug
-- in the code (see limiter.lua). The policy's limit is the daemon's: a
-- cost above it is refused as INVALID_COST (invalid_status); here only its
-- form is checked.
local function args(self, key, cost)
    if getmetatable(self) ~= mt then
        error("call it as lim:limit(key, cost) / lim:check(key, cost), with a colon, on an object from new()", 3)
    end
    local wkey, err = wire_key(key)
    if not wkey then
        error(err, 3)
    end
    if cost == nil then
        return wkey, 1
    end
    if type(cost) ~= "number" or cost < 1 or cost > 4294967295 or floor(cost) ~= cost then
        error("cost must be a positive integer", 3)
    end
    return wkey, cost
end

--- Asks the daemon: the decision table (limit: the policy's for this key,
-- policy: its name), or nil and an error.
function Policy.check(self, key, cost)
    local wkey, c = args(self, key, cost)
    return Policy._decide(self, wkey, c)
end

--- For access_by_lua*: as the inline limiter's limit().
function Policy.limit(self, key, cost)
    local wkey, c = args(self, key, cost)
    return http.enforce(self, self, wkey, c)
end

--- new{ policy = name, ... }: the limiter, or nil and a message.
function _M.new(opts)
    local on_error, err = options.check("policy", opts)
    if not on_error then
        return nil, "new: " .. err
    end
    local name = opts.policy
    local lim = setmetatable({
        _policy = name,
        _on_error = on_error,
        _local_limit = opts.local_limit,
        _window_ms = opts.window_ms,
        _header = wire.policy_header(0, on_error, 1, opts.local_limit),
        -- After the key length: the name's length and the name.
        _name_part = char(#name) .. name,
        _shadow = options.name_set(opts.shadow),
    }, mt)
    return options.copy_behaviour(lim, opts)
end

return _M

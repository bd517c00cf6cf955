-- resty.ratelimitd.policy: a limiter of one named policy (CHECK_POLICY of
-- one item): the daemon holds its limit, window, algorithm, overrides and
-- allowlist (docs/POLICIES.md); the frame carries the name, the key and
-- the cost. The location's on_error decides when the daemon gives no
-- decision, and when the name is unknown to it; without one, the policy's
-- own on_error (as the daemon describes it), else open.
-- With on_error = "local", local_limit is the per-host quota and window_ms
-- the window of this client's own fallback; both default to the policy's,
-- which the limiter asks the daemon for (DESCRIBE_POLICY, verify.lua)
-- when the worker starts, or at its first request.
-- No denial cache here: it is keyed by limit and window, which the daemon
-- holds and a reload may change; the daemon's own cache applies.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local kind = require "resty.ratelimitd.kind"

local char = string.char
local ngx = ngx
local next_id, ask = conn.next_id, conn.ask
local check_policy, policy_item = wire.check_policy, wire.policy_item
local share_first, kind_header = kind.share_first, kind.header

local _M = {}

local Policy, mt, checked = kind.class("call it as lim:limit(key, cost) / lim:check(key, cost), with a colon, on an object from new()")

-- The frame's constant header: flags, the location's on_error, one item,
-- its local quota. nil while on_error is "local" and the quota is not
-- known (neither given in nginx nor yet described by the daemon).
local function header(self)
    local on_error, local_limit = self._on_error, self._local_limit
    if on_error == "local" and not local_limit then
        return nil
    end
    self._header = wire.policy_header(0, on_error, 1, local_limit)
    return self._header
end

-- CHECK_POLICY of one item, its header built once (described first if it
-- must be: kind.header).
local function ask_policy(self, key, cost)
    local h, err = kind_header(self, header)
    if not h then
        return nil, err
    end
    local id = next_id()
    return ask(self, check_policy(id, h, policy_item(cost, self._name_part, key)), id)
end

-- A hot key is admitted from the host's worker share of the daemon's quota lease, with
-- no round trip (share.lua), else asked.
function Policy._decide(self, key, cost)
    return share_first(self, key, cost, ask_policy)
end

-- The LEASE_SHARE frame (op 10) of `units` for `key`, or nil while the
-- header is not built (at the first request; a description clears it).
function Policy._share_frame(self, id, units, key, back)
    local h = self._header
    return h and wire.lease_share(id, h, units, self._name_part, key, back)
end

-- A description changed on_error or the local quota: the header is built
-- again at the next request.
function Policy._on_described(self)
    self._header = nil
end

kind.rate_methods(Policy, checked)

--- new{ policy = name, ... }: the limiter, or nil and a message.
_M.new = kind.constructor(mt, "policy", "new: ", function(opts)
    local name = opts.policy
    return {
        _policy = name,
        _window_ms = opts.window_ms,
        _window_given = opts.window_ms ~= nil,
        _takes_description = true,
        _kind_wanted = "rate",
        -- After the key length: the name's length and the name.
        _name_part = char(#name) .. name,
        -- Worker shares of the daemon's quota leases: the dict named, false
        -- (off), or nil: configure()'s shared_dict (share.dict).
        _share_dict = opts.share_dict and ngx.shared[opts.share_dict],
        _share_prefix = "\2" .. char(#name) .. name,
    }
end)

return _M

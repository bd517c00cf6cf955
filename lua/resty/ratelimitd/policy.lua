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
local kind = require "resty.ratelimitd.kind"
local share = require "resty.ratelimitd.share"

local char = string.char
local ngx = ngx
local next_id, ask = conn.next_id, conn.ask
local check_policy, policy_item = wire.check_policy, wire.policy_item

local _M = {}

local Policy, mt, checked = kind.class("call it as lim:limit(key, cost) / lim:check(key, cost), with a colon, on an object from new()")

function Policy._decide(self, key, cost)
    -- share_dict: a hot key is admitted from the host's share of the
    -- daemon's lease, with no round trip (share.lua).
    local dict = self._share_dict
    if dict then
        local res = share.admit(self, dict, key, cost)
        if res then
            return res
        end
    end
    local id = next_id()
    local res, err = ask(self, check_policy(id, self._header, policy_item(cost, self._name_part, key)), id)
    if dict and res and res.decision == "allowed" and res.source == "redis" then
        share.refill(self, dict, key, res)
    end
    return res, err
end

kind.rate_methods(Policy, checked)

--- new{ policy = name, ... }: the limiter, or nil and a message.
_M.new = kind.constructor(mt, "policy", "new: ", function(opts, on_error)
    local name = opts.policy
    return {
        _policy = name,
        _window_ms = opts.window_ms,
        _header = wire.policy_header(0, on_error, 1, opts.local_limit),
        -- After the key length: the name's length and the name.
        _name_part = char(#name) .. name,
        -- Worker shares of the daemon's quota leases (nil: off).
        _share_dict = opts.share_dict and ngx.shared[opts.share_dict],
    }
end)

return _M

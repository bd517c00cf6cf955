-- resty.ratelimitd.multi: several named policies in one request, all or
-- nothing, and refundable checks (docs/POLICIES.md; PROTOCOL.md 4b, 4c, 5b).
--
--   api = assert(ratelimitd.new{ policies = { "per_ip", "per_tenant", "global" },
--                                on_error = "closed", refundable = true })
--   local res = api:limit({ ngx.var.remote_addr, tenant, "all" })   -- keys in policy order
--   ... log_by_lua: ratelimitd.refund(res.handle)
--
-- A one-policy limiter with refundable = true is the same object
-- (new{ policy = "login", refundable = true }; its key may be a string).
-- Its decision table always goes to ngx.ctx.ratelimitd (for the refund in
-- log_by_lua, refund.lua).

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local kind = require "resty.ratelimitd.kind"
local http = require "resty.ratelimitd.http"

local char = string.char
local floor = math.floor
local concat = table.concat
local type, ipairs = type, ipairs
local next_id, ask = conn.next_id, conn.ask
local policy_item, check_policy = wire.policy_item, wire.check_policy
local wire_key = kind.wire_key

local _M = {}

-- The items of one request: keys (wire keys) and costs in policy order.
local function items(self, keys, costs)
    local parts = {}
    for i = 1, self._n do
        parts[i] = policy_item(costs[i], self._name_parts[i], keys[i])
    end
    return concat(parts)
end

local KEYS_MSG = "keys must be a list of one key per policy"

-- The arguments of a request: the wire keys and the costs in policy order,
-- or nil and what is wrong (raised at the caller's line: keys not a list, a
-- bad cost). What a key holds never raises (kind.lua): an absent header in
-- the list is the empty key.
local function args(keys, cost, _, self)
    local n = self._n
    if type(keys) ~= "table" then
        if n ~= 1 then
            return nil, KEYS_MSG .. " (" .. n .. ")"
        end
        keys = { keys }
    end
    local wire_keys, costs = {}, {}
    for i = 1, n do
        local wkey, err = wire_key(keys[i])
        if not wkey then
            return nil, err
        end
        wire_keys[i] = wkey
        local c = cost
        if type(cost) == "table" then
            c = cost[i]
        end
        if c == nil then
            c = 1
        end
        if type(c) ~= "number" or c < 1 or c > 4294967295 or floor(c) ~= c then
            return nil, "cost must be a positive integer, or a list of them"
        end
        costs[i] = c
    end
    return wire_keys, costs
end

local Multi, mt, checked = kind.class("call it as lim:limit(keys, cost), with a colon, on an object from new{ policies = ... }", args)

-- The frame's constant header: flags, the location's on_error, the item
-- count, the local quota. With on_error = "local" and no local_limit in
-- nginx, the daemon needs a quota only for the policies without an
-- on_error of their own (a policy's own on_error and local_limit win,
-- decision/resolve.rs); nil while the policies are not described, or when
-- one of them has neither (no quota anywhere: said per request). When
-- every policy brings its own, the frame's quota is never used: the
-- largest of theirs stands in (the frame must carry one, 1..max_limit).
local function header(self)
    local local_limit = self._local_limit
    if self._on_error == "local" and not local_limit then
        local quotas = self._local_limits
        if not quotas then
            return nil
        end
        local_limit = 0
        for i = 1, self._n do
            local q = quotas[i]
            if not q then
                return nil
            end
            if q > local_limit then
                local_limit = q
            end
        end
    end
    self._header = wire.policy_header(self._flags, self._on_error, self._n, local_limit)
    return self._header
end

-- The description arrived: the header is built again at the next request.
function Multi._on_described(self)
    self._header = nil
end

function Multi._decide(self, keys, costs)
    -- Built once; described first if it must be (kind.header).
    local h, err = kind.header(self, header)
    if not h then
        return nil, err
    end
    local body = items(self, keys, costs)
    local id = next_id()
    local res, ext = ask(self, check_policy(id, h, body), id)
    if not res then
        return nil, ext
    end
    if ext then
        wire.parse_extension(res, ext, self._names, self._shadow)
        if res.handle then
            -- The refund frame repeats the items after the handle.
            res.handle = char(self._n) .. res.handle .. body
        end
    end
    return res
end

Multi._fallback = http.fallback_many

function Multi._label(_, keys)
    return concat(keys, ",")
end

kind.rate_methods(Multi, checked)

--- new{ policies = { ... } } or new{ policy = name, refundable = true }:
-- the limiter, or nil and a message.
_M.new = kind.constructor(mt, "multi", "new: ", function(opts)
    local names = opts.policies or { opts.policy }
    local parts = {}
    for i, name in ipairs(names) do
        parts[i] = char(#name) .. name
    end
    return {
        _names = names,
        _n = #names,
        _policy = names[1],
        -- What its failure lines name.
        _policy_label = table.concat(names, ","),
        -- Given in nginx, the window of every policy's own fallback; else
        -- each policy's, once described (verify.apply_many: _windows,
        -- _local_limits).
        _window_ms = opts.window_ms,
        _window_given = opts.window_ms ~= nil,
        -- settle = true: the check reserves its cost (PROTOCOL.md 4f, settle.lua).
        _flags = opts.settle and 2 or (opts.refundable and wire.FLAG_REFUNDABLE or 0),
        _name_parts = parts,
        _set_ctx = true,
    }
end)

return _M

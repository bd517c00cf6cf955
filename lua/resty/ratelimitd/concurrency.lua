-- resty.ratelimitd.concurrency: concurrency limits (docs/ALGORITHMS.md,
-- "Concurrency"): at most `limit` requests in flight per key across every
-- host.
--
--   init_by_lua_block    { conns = assert(require("resty.ratelimitd").concurrency{ limit = 10, lease_ms = 60000 }) }
--                        -- or of a named policy (algorithm = "concurrency"):
--                        { uploads = assert(require("resty.ratelimitd").concurrency{ policy = "uploads" }) }
--   access_by_lua_block  { conns:enter(ngx.var.http_x_tenant_id) }
--   log_by_lua_block     { require("resty.ratelimitd").leave() }   -- server level
--
-- enter() acquires a lease named by the request's $request_id (refused:
-- 429, as limit()); leave(), in the log phase, which runs for every
-- request, aborted ones included, releases the request's leases from a
-- timer (cosockets are not available in the log phase). A lease never
-- released (nginx killed, the daemon unreachable then) stops counting
-- lease_ms after it was taken.
--
-- A request keeps its leases across internal redirects (error_page,
-- try_files, ngx.exec, named locations), which clear ngx.ctx (request.lua):
-- enter() after a redirect finds the lease the request already holds
-- instead of taking a second slot, and leave() in whichever location the
-- request ends in releases it.

local request = require "resty.ratelimitd.request"
local kind = require "resty.ratelimitd.kind"
local http = require "resty.ratelimitd.http"
local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local log_failure = require("resty.ratelimitd.config").failure

local ngx = ngx
local char = string.char
local ipairs, tostring = ipairs, tostring
local next_id, ask = conn.next_id, conn.ask
local OP_ACQUIRE, OP_RELEASE = wire.OP_ACQUIRE, wire.OP_RELEASE

local _M = {}

-- No check() or limit(): a lease taken without enter() would never be
-- released.
local Concurrency, mt, checked = kind.class("enter() is a method of a limiter from ratelimitd.concurrency{}: conns:enter(key)")

-- One ACQUIRE (or RELEASE, `op`) of the concurrency lease `lease_id` for `key`.
local function exchange(self, key, cost, lease_id, op)
    local id = next_id()
    local frame
    if self._policy then
        frame = wire.acquire_policy(id, op == OP_RELEASE and self._release_header or self._acquire_header, cost, self._name_part, key, lease_id)
    else
        frame = wire.concurrency_lease(op, id, self._before_cost, self._after_cost, cost, key, lease_id)
    end
    return ask(self, frame, id)
end

function Concurrency._decide(self, key, cost, lease_id)
    return exchange(self, key, cost, lease_id, OP_ACQUIRE)
end

-- Sources under which the daemon holds a lease to give back.
local LEASED = { redis = true, memory = true, ["local"] = true }

--- For access_by_lua*: acquires a slot of this limiter for the request, or
-- ends it as limit() does. Returns the decision table. Called again for
-- the same key in the same request (after an internal redirect), it
-- returns the first decision: a request holds one slot.
function Concurrency.enter(self, key, cost)
    local wkey, c = checked(self, key, cost)
    local id, held = request.leases()
    if held then
        for _, h in ipairs(held) do
            if h[1] == self and h[2] == wkey then
                return h[4]
            end
        end
    end
    local res = http.enforce(self, self, wkey, c, id)
    if res and res.allowed and LEASED[res.source] then
        request.hold(id, { self, wkey, c, res }, self._lease_s)
    end
    return res
end

local function release_all(_premature, held, lease_id)
    for _, h in ipairs(held) do
        local res, err = exchange(h[1], h[2], h[3], lease_id, OP_RELEASE)
        if not res then
            log_failure("release", h[2], tostring(err) .. " (the lease expires after lease_ms)")
        elseif res.decision == "error" then
            log_failure("release", h[2], res.error .. ": " .. res.message)
        end
    end
end

--- For log_by_lua*: releases every lease enter() took for this request,
-- in whichever location it ended.
function _M.leave()
    local id, held = request.take_leases()
    if not held then
        return
    end
    local ok, err = ngx.timer.at(0, release_all, held, id)
    if not ok then
        log_failure("release", held[1][2], "timer: " .. tostring(err) .. " (the lease expires after lease_ms)")
    end
end

-- An inline concurrency limit: its limit and lease are the location's.
local new_inline = kind.constructor(mt, "concurrency", "concurrency: ", function(opts, on_error)
    local before, after = wire.check_parts("log", on_error, opts.limit, opts.lease_ms, opts.local_limit)
    return { _limit = opts.limit, _window_ms = opts.lease_ms, _before_cost = before, _after_cost = after, _lease_s = opts.lease_ms / 1000 }
end)

-- A named policy (algorithm = "concurrency", docs/POLICIES.md): the daemon
-- holds its limit, lease, overrides and allowlist; the frame (op 7) carries
-- the name, the key, the cost and the lease id. With on_error = "local",
-- local_limit is the per-host quota and lease_ms the window of this
-- client's own fallback.
local new_policy = kind.constructor(mt, "concurrency_policy", "concurrency: ", function(opts, on_error)
    local name = opts.policy
    return {
        _policy = name,
        _kind_wanted = "concurrency",
        _window_ms = opts.lease_ms,
        _acquire_header = wire.policy_header(0, on_error, 1, opts.local_limit),
        _release_header = wire.policy_header(wire.FLAG_RELEASE, on_error, 1, opts.local_limit),
        _name_part = char(#name) .. name,
        -- The policy's lease is the daemon's: the worker forgets a
        -- request's leases after an hour at most if leave() never ran.
        _lease_s = (opts.lease_ms or 3600000) / 1000,
    }
end)

--- concurrency{ limit, lease_ms, ... } or concurrency{ policy = name, ... }:
-- the limiter, or nil and a message.
function _M.new(opts)
    if opts.policy ~= nil then
        return new_policy(opts)
    end
    return new_inline(opts)
end

return _M

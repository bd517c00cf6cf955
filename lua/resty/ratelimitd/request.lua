-- resty.ratelimitd.request: what a request keeps across internal redirects
-- (error_page, try_files, ngx.exec, named locations), which clear ngx.ctx
-- and run the access phase again in the new location: the decisions its
-- limit() calls made, so that the same limiter deciding the same request
-- again reuses its first answer (no second count), and its decision table
-- for a later refund() or settle() (decision()). leases.lua keeps a
-- request's concurrency leases under the same identity (id()).
--
-- A request is known by its $request_id when the configuration indexes it
-- (the snippet's `map $request_id $ratelimitd_request_id`): the same for the
-- whole request. Without that line each read of $request_id makes a new id;
-- the request is then known by what nginx keeps for it across redirects:
-- the address of its request object, its start time (ms), its connection's
-- serial number and the connection's count of requests. Two requests of a
-- worker alive at once never share the address; a later request that gets
-- the freed address also has the same start millisecond, connection and
-- request count only if it is the same request. nginx makes all of these:
-- nothing a client sends chooses the identity.
--
-- Bounded: the worker keeps the decisions of the requests it decided last,
-- in two generations of GENERATION requests each; a full current
-- generation becomes the previous one and the older is dropped. So a
-- request's decisions are found again as long as fewer than GENERATION
-- other requests of the same worker were decided between its first decision
-- and its redirect (at least 1,024 requests, at most 2,048): always for
-- try_files, ngx.exec and an error_page of the access or content phase; an
-- error_page after a slow upstream on a busy worker may miss, and then it
-- is decided again (counted twice, as before this module).

local ngx = ngx
local concat = table.concat
local type, tostring, require = type, tostring, require
local match, sub = string.match, string.sub

local _M = {}

local GENERATION = 1024
_M.GENERATION = GENERATION

-- request id -> { [limiter] = { [key|cost] = decision table }, ctx = the
-- decision table of ngx.ctx.ratelimitd }
local current, previous, entries = {}, {}, 0

-- nil until the first request has looked: whether $request_id is the same
-- at each read (indexed).
local stable_id

-- The request object's address, from lua-resty-core (which the Lua module
-- requires since 0.10.16), and 12 hex digits of nginx's own randomness (one
-- $request_id): loaded at the first request without an indexed $request_id.
-- The digits tell apart two workers or hosts whose requests share an
-- address, start and connection numbers (each host counts connections from
-- 1): a lease id need only be unique among the key's leases.
local get_request, worker_token

-- The identity nginx keeps for a request across its internal redirects,
-- when $request_id is not indexed (see above): at most 12 + 12 + 1 + 14 +
-- 1 + 10 + 1 + 10 bytes, within a lease id's 64, without a space or `#`.
local function own_id()
    local var = ngx.var
    if not get_request then
        get_request = require("resty.core.base").get_request
        worker_token = sub(var.request_id, 1, 12)
    end
    return worker_token .. match(tostring(get_request()), "0x(%x+)") .. "-" .. ngx.req.start_time() .. "-" .. var.connection .. "-" .. var.connection_requests
end

--- The request's identity, the same across internal redirects: its
-- $request_id when indexed, else what nginx keeps for it (own_id).
function _M.id()
    if stable_id == false then
        return own_id()
    end
    local id = ngx.var.request_id
    if stable_id == nil then
        stable_id = ngx.var.request_id == id
        if not stable_id then
            return own_id()
        end
    end
    return id
end

-- The entry of the request (made when `make`), or nil. One table per
-- request: limiter -> its last decision table, that table -> the call it
-- answered (call_of), and `ctx`.
local function entry(make)
    local id = _M.id()
    local e = current[id]
    if e then
        return e
    end
    e = previous[id]
    if not e then
        if not make then
            return nil
        end
        e = {}
    end
    if entries >= GENERATION then
        previous, current, entries = current, {}, 0
    end
    current[id] = e
    entries = entries + 1
    return e
end

-- A string naming the key(s) and cost(s) of a call: the key itself for
-- the usual one key of cost 1 (no string made). A wire key holds no control
-- byte, so "\1" and "\2" cannot be part of one.
local function call_of(key, cost)
    if cost == 1 and type(key) == "string" then
        return key
    end
    if type(key) == "table" then
        key = concat(key, "\1")
    end
    if type(cost) == "table" then
        cost = concat(cost, "\1")
    end
    return key .. "\2" .. cost
end

--- The decision `lim` made for `key` of `cost` earlier in this request
-- (before an internal redirect), or nil; then the request's entry and the
-- call, for remember().
function _M.decided(lim, key, cost)
    local e = entry(true)
    if not e then
        return nil
    end
    local call = call_of(key, cost)
    local res = e[lim]
    if res and e[res] == call then
        return res
    end
    return nil, e, call
end

--- Records `res` as `lim`'s answer to `call` in the request's entry `e`
-- (from decided()). Only the last call of a limiter is kept: another key
-- of it in the same request is decided on its own.
function _M.remember(e, lim, call, res)
    local old = e[lim]
    if old then
        e[old] = nil
    end
    e[lim] = res
    e[res] = call
end

--- Keeps `res` as the request's decision table: what decision() returns
-- after a redirect.
function _M.keep(res)
    local e = entry(true)
    if e then
        e.ctx = res
    end
end

--- The request's decision table (ngx.ctx.ratelimitd: of the last limiter
-- that sets it, multi-item, refundable and settle ones always), also after
-- an internal redirect, which clears ngx.ctx; nil when none decided.
function _M.decision()
    local res = ngx.ctx.ratelimitd
    if res then
        return res
    end
    local e = entry(false)
    return e and e.ctx
end

return _M

-- resty.ratelimitd.request: what a request keeps across internal redirects
-- (error_page, try_files, ngx.exec, named locations), which clear ngx.ctx
-- and run the access phase again in the new location: the decisions its
-- limit() calls made, so that the same limiter deciding the same request
-- again reuses its first answer (no second count), and its decision table
-- for a later refund() or settle() (decision()), and the concurrency
-- leases it holds until leave() (leases(), hold(), take_leases()): the
-- client's one per-request store.
--
-- A request is found by the address of its nginx request object, which a
-- redirect keeps, and told from an earlier request that nginx placed at the
-- same address by $connection (a number nginx gives each connection, never
-- twice on the host), $connection_requests (the request's number on it,
-- the same across redirects) and its start time (ms). nginx makes all of
-- them: nothing a client sends chooses them, and no line in nginx.conf is
-- needed. $request_id would do too,
-- but its first read per request draws 16 random bytes (OpenSSL) and every
-- request would make a new 32-byte string and table here: measured at about
-- 2 of the 3 us a request admitted from a worker share cost this module
-- (docs/PERFORMANCE.md, "The share path in a worker (issue 34, item 3)"). The entry of an
-- address is reused by the next request placed there: no table per request.
--
-- The identity of a request as a string (id(), a concurrency lease's id):
-- its $request_id when the configuration indexes it (the snippet's `map
-- $request_id $ratelimitd_request_id`), the same for the whole request;
-- else the same parts as above, after 12 hex digits of one $request_id per
-- worker, which tell apart two workers or hosts whose requests share an
-- address, start and connection numbers.
--
-- Bounded: the worker keeps the entries of the request addresses it saw
-- last, in two generations of GENERATION addresses each; a full current
-- generation becomes the previous one and the older is dropped. An address
-- recurs (nginx reuses a request object's memory for the next request on
-- a connection), so a new generation starts only after GENERATION addresses
-- new to the worker, at least 1,024: a request's decisions are found again
-- unless that many requests with new addresses were decided between its
-- first decision and its redirect (then it is decided again, counted
-- twice, as before this module).

local ngx = ngx
local ngx_now = ngx.now
local pairs = pairs
local concat = table.concat
local type, tonumber = type, tonumber
local format, sub = string.format, string.sub
local get_request = require("resty.core.base").get_request
local clear = require "table.clear"
local ffi = require "ffi"
local cast = ffi.cast

local _M = {}

local GENERATION = 1024
_M.GENERATION = GENERATION

-- request address -> entry: { conn = $connection, nth = $connection_requests,
-- start = the request's start time,
-- [limiter] = its last decision table, [that table] = the call it answered
-- (call_of), ctx = the decision table of ngx.ctx.ratelimitd }
local current, previous, entries = {}, {}, 0

-- nil until the first request has looked: whether $request_id is the same
-- at each read (indexed).
local stable_id

-- 12 hex digits of nginx's own randomness (one $request_id), read at the
-- first request without an indexed $request_id.
local worker_token

-- The identity nginx keeps for a request across its internal redirects,
-- when $request_id is not indexed (see above): at most 12 + 12 + 1 + 14 +
-- 1 + 10 + 1 + 10 bytes, within a lease id's 64, without a space or `#`.
local function own_id()
    local var = ngx.var
    if not worker_token then
        worker_token = sub(var.request_id, 1, 12)
    end
    local at = format("%x", tonumber(cast("uintptr_t", get_request())))
    return worker_token .. at .. "-" .. ngx.req.start_time() .. "-" .. var.connection .. "-" .. var.connection_requests
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
-- request address, emptied when a later request at the address uses it.
local function entry(make)
    local r = get_request()
    if not r then
        return nil
    end
    -- A number: a cdata pointer as a table key would be a new key each time.
    local at = tonumber(cast("uintptr_t", r))
    local var = ngx.var
    local conn, nth, start = var.connection, var.connection_requests, ngx.req.start_time()
    local e = current[at]
    if not e then
        e = previous[at]
        if not e then
            if not make then
                return nil
            end
            e = { conn = conn, nth = nth, start = start }
        end
        if entries >= GENERATION then
            previous, current, entries = current, {}, 0
        end
        current[at] = e
        entries = entries + 1
    end
    if e.conn ~= conn or e.nth ~= nth or e.start ~= start then
        -- An earlier request's, at the same address.
        if not make then
            return nil
        end
        clear(e)
        e.conn, e.nth, e.start = conn, nth, start
    end
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

-- The concurrency leases held by requests of this worker: request id ->
-- list of { limiter, wire key, cost, decision }, with `expires` (s): after
-- it the daemon has dropped every lease of the list, so an entry whose
-- request never reached leave() (no log_by_lua where it ended) is swept.
-- Kept by the request's identity (id()), not in its entry above: a lease
-- must outlive any number of requests decided while its request runs (a
-- long upload), which the entries' two generations do not promise.
local held_by_request, holders, sweep_at = {}, 0, 1024

local function sweep()
    local now = ngx_now()
    holders = 0
    for id, held in pairs(held_by_request) do
        if held.expires < now then
            held_by_request[id] = nil
        else
            holders = holders + 1
        end
    end
    sweep_at = holders * 2 > 1024 and holders * 2 or 1024
end

--- The request's identity (the lease id) and the list of leases it holds
-- (nil for none).
function _M.leases()
    local id = _M.id()
    return id, held_by_request[id]
end

--- Records `lease` ({ limiter, wire key, cost, decision }) as held by the
-- request `id` (from leases()) for at most `lease_s` seconds.
function _M.hold(id, lease, lease_s)
    local expires = ngx_now() + lease_s
    local held = held_by_request[id]
    if not held then
        -- The sweep first: it must not see this request's list before
        -- its expiry is set.
        if holders >= sweep_at then
            sweep()
        end
        held = { expires = expires }
        held_by_request[id] = held
        holders = holders + 1
    end
    if expires > held.expires then
        held.expires = expires
    end
    held[#held + 1] = lease
end

--- The request's leases, forgotten by the worker (nil when it holds
-- none), and its identity: the lease id to release them under.
function _M.take_leases()
    local id, held = _M.leases()
    if not held then
        return id, nil
    end
    held_by_request[id] = nil
    holders = holders - 1
    return id, held
end

--- How many requests of this worker hold leases now (for tests).
function _M.lease_holders()
    return holders
end

return _M

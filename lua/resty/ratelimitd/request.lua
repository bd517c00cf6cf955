-- resty.ratelimitd.request: what a request keeps across internal redirects
-- (error_page, try_files, ngx.exec, named locations), which clear ngx.ctx
-- and run the access phase again in the new location: the decisions its
-- limit() calls made, so that the same limiter deciding the same request
-- again reuses its first answer (no second count), and its decision table
-- for a later refund() or settle() (decision()).
--
-- A request is known by its $request_id, the same for the whole request once
-- the configuration indexes it (the snippet's `map $request_id
-- $ratelimitd_request_id`; unindexed, each read makes a new id, and nothing
-- is kept: each run of the access phase decides, as before). nginx makes
-- the id (random hex): nothing a client sends chooses it.
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
local type = type

local _M = {}

local GENERATION = 1024
_M.GENERATION = GENERATION

-- request id -> { [limiter] = { [key|cost] = decision table }, ctx = the
-- decision table of ngx.ctx.ratelimitd }
local current, previous, entries = {}, {}, 0

-- nil until the first request has looked: whether $request_id is the same
-- at each read (indexed).
local stable_id

--- The request's identity, the same across internal redirects when
-- `stable` (else only $request_id of this read).
function _M.id()
    local id = ngx.var.request_id
    if stable_id == nil then
        stable_id = ngx.var.request_id == id
    end
    return id, stable_id
end

-- The entry of the request (made when `make`), or nil. One table per
-- request: limiter -> its last decision table, that table -> the call it
-- answered (call_of), and `ctx`.
local function entry(make)
    local id, stable = _M.id()
    if not stable or not id then
        return nil
    end
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
-- call, for remember(); nil entry when the request has no stable id.
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

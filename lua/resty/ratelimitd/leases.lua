-- resty.ratelimitd.leases: the concurrency leases each request of this
-- worker holds, kept so that they survive internal redirects (error_page,
-- try_files, ngx.exec, named locations), which clear ngx.ctx. A request is
-- known by its identity from request.lua (its $request_id when the
-- configuration indexes it, else what nginx keeps for the request across
-- redirects: no line in nginx.conf is needed); the leases are kept in a
-- table of the worker under it.

local request_id = require("resty.ratelimitd.request").id

local ngx = ngx
local ngx_now = ngx.now
local pairs = pairs

local _M = {}

-- The leases held by requests of this worker: request id -> list of
-- { limiter, wire key, cost, decision }, with `expires` (s): after it the
-- daemon has dropped every lease of the list, so an entry whose request
-- never reached leave() (no log_by_lua where it ended) is swept.
local held_by_request, entries, sweep_at = {}, 0, 1024

local function sweep()
    local now = ngx_now()
    entries = 0
    for id, held in pairs(held_by_request) do
        if held.expires < now then
            held_by_request[id] = nil
        else
            entries = entries + 1
        end
    end
    sweep_at = entries * 2 > 1024 and entries * 2 or 1024
end

--- The request's identity, the same across internal redirects, and the
-- list of leases it holds (nil for none).
function _M.of_request()
    local id = request_id()
    return id, held_by_request[id]
end

--- Records `lease` ({ limiter, wire key, cost, decision }) as held by the
-- request `id` (from of_request) for at most `lease_s` seconds.
function _M.remember(id, lease, lease_s)
    local expires = ngx_now() + lease_s
    local held = held_by_request[id]
    if not held then
        -- The sweep first: it must not see this request's list before
        -- its expiry is set.
        if entries >= sweep_at then
            sweep()
        end
        held = { expires = expires }
        held_by_request[id] = held
        entries = entries + 1
    end
    if expires > held.expires then
        held.expires = expires
    end
    held[#held + 1] = lease
end

--- The request's leases, forgotten by the worker (nil when it holds
-- none), and its identity: the lease id to release them under.
function _M.take()
    local id, held = _M.of_request()
    if not held then
        return id, nil
    end
    held_by_request[id] = nil
    entries = entries - 1
    return id, held
end

--- How many requests of this worker hold leases now (for tests).
function _M.requests()
    return entries
end

return _M

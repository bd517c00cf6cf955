-- resty.ratelimitd.cache: the denial cache (docs/NGINX.md, section 4).
-- After the daemon refuses (source redis or denial_cache) a key with this
-- limit and window, later requests for it of at least the refused cost are
-- refused here, without a round trip, until the daemon could admit them.
-- Exact for the same reason as the daemon's own cache: a refusal records
-- nothing and counts only fall by expiry, so Redis refuses such a request
-- until the retry time. The entry is anchored at the time the request was
-- sent (taken before the send: only earlier), ends 1 ms + 0.05 % early
-- (Redis reads whole ms; clock rates) and lives at most
-- denial_cache_max_ms. Kept in the shared dict with safe_set: it never
-- evicts the local fallback's counters; when the dict is full, no entry is
-- made. Value: expiry, retry time and reset time (µs, monotonic), count and
-- remaining as the daemon answered; flags: the refused cost. Times are of
-- the monotonic clock (conn.mono_us, read by the limiter before its send).

local wire = require "resty.ratelimitd.wire"

local u32, be32, u56, be56 = wire.u32, wire.be32, wire.u56, wire.be56
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min

local _M = {}

--- The refusal cached for `ckey` that a request of `cost` at `now` (µs)
-- still meets, as a decision table (source lua_denial_cache), or nil.
function _M.refusal(dict, ckey, cost, now, limit)
    local v, min_cost = dict:get(ckey)
    if not v or cost < min_cost or now >= be56(v, 1) then
        return nil
    end
    local retry = max(1, ceil((be56(v, 8) - now) / 1000) - 1)
    return {
        allowed = false,
        decision = "denied",
        source = "lua_denial_cache",
        count = be32(v, 22),
        remaining = be32(v, 26),
        retry_after_ms = retry,
        reset_ms = max(retry, ceil((be56(v, 15) - now) / 1000) - 1),
        error_code = 0,
        error = "OK",
        message = "",
        limit = limit,
    }
end

--- How long (ms) a refusal of retry_after_ms `r` may be cached: 1 ms and
-- 0.05 % of the wait early, at most `max_ms`; below 1 ms not at all (nil).
function _M.life_ms(r, max_ms)
    local life = min(r - 1 - min(r, max_ms) / 2000, max_ms)
    if life < 1 then
        return nil
    end
    return life
end

--- Remembers the daemon's refusal `res` of `cost` for `ckey`, sent at
-- `sent` (µs, monotonic).
function _M.remember(dict, ckey, cost, res, sent, max_ms)
    local life_ms = _M.life_ms(res.retry_after_ms, max_ms)
    if not life_ms then
        return
    end
    local value = u56(sent + floor(life_ms * 1000)) .. u56(sent + res.retry_after_ms * 1000) .. u56(sent + res.reset_ms * 1000)
        .. u32(res.count) .. u32(res.remaining)
    -- The dict's own expiry (wall clock) only frees the memory; the
    -- monotonic expiry in the value decides.
    dict:safe_set(ckey, value, life_ms / 1000 + 0.001, cost)
end

return _M

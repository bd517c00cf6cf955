-- One key and window (a single check, a coalesced batch, or mode 'L'), or
-- different keys in one call (mode 'B'): request j is decided on its key
-- exactly as a call of its own at the same instant would decide it.
--
-- Mode 'B', different keys in one call (cold keys queued at the same
-- moment; one Redis, or keys of one Cluster slot): ARGV[1] 'B', ARGV[2] now
-- (0: Redis TIME), ARGV[3] member base, then per key i: window, limit,
-- cost. Each key is decided exactly as a single call of its own at the same
-- instant would (its member "<base>.k<i>", ":<u>" per unit of cost); a key
-- named twice is decided in order, the first admission counting for the
-- second. Returns per key {allowed, count, remaining, retry_after_ms,
-- reset_ms}, flat.
--
-- Mode 'L', a quota lease (docs/PERFORMANCE.md, "Quota leases"): a daemon
-- that sees a key often reserves units of its quota and admits from them
-- locally. ARGV[1] 'L', ARGV[2] window, ARGV[3] now (0: Redis TIME), ARGV[4]
-- member base, ARGV[5] limit, ARGV[6] cost, ARGV[7] units wanted, ARGV[8]
-- lease life in ms. The request itself is decided as a single check; if it
-- is admitted, up to min(wanted, floor(room left / 2)) units are reserved as
-- "<base>.l<u>", scored now + life: the latest true time of any admission
-- made from them (the daemon admits from a lease only until life ms after it
-- sent this call), so each unit counts for a full window after the admission
-- it may stand for, settled or not (a daemon killed holding a lease
-- over-admits nothing). Returns {allowed, count, remaining, retry_after_ms,
-- reset_ms, granted, now}; count includes the request and the units, and
-- remaining excludes both. Its settle is sliding_window/lease_settle.lua.
--
-- Expiry, in every writing path: a key that existed before the call
-- (count > 0 after the clean-up) may hold a lease's units, scored up to
-- life ms ahead and kept by an expiry of now + life + window, so its
-- expiry is only ever extended (PEXPIRE ... GT); a key the call created
-- holds none and has no expiry yet (GT would never set one), so it gets a
-- plain PEXPIRE. One PEXPIRE per admitting call either way, as before
-- leases: no PTTL.
local key = KEYS[1]
local window = tonumber(ARGV[1])
local base = ARGV[3]
local n = (#ARGV - 3) / 2
-- Where request j's fields sit: limit at ARGV[2 + o + s * j], cost next,
-- and in mode 'B' its window just before (a stride s of 3).
local lease, batch, o, s = ARGV[1] == 'L', ARGV[1] == 'B', 0, 2
local want, life = 0, 0
if lease then
  window, base, n, o = tonumber(ARGV[2]), ARGV[4], 1, 1
  want, life = tonumber(ARGV[7]), tonumber(ARGV[8])
elseif batch then
  base, n, s = ARGV[3], #KEYS, 3
end

local out = {}
local count, fresh, admitted, granted = 0, false, false, 0

for j = 1, n do
  local limit = tonumber(ARGV[2 + o + s * j])
  local cost = tonumber(ARGV[3 + o + s * j])
  if batch or j == 1 then
    if batch then
      key, window = KEYS[j], tonumber(ARGV[1 + s * j])
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
    count = redis.call('ZCARD', key)
    fresh, admitted = count == 0, false
  end
  -- Members stay unique across the call: "<base>" alone for a lone
  -- request, "<base>.<j>" for the j-th of a batch, "<base>.k<j>" for key
  -- j of mode 'B'; ":<i>" per unit of cost; a lease's units "<base>.l<u>".
  local member = base
  if batch then
    member = base .. '.k' .. j
  elseif n > 1 then
    member = base .. '.' .. j
  end
  if count + cost <= limit then
    if lease then
      -- Mode 'L': at most half the room left after the request, all the
      -- way to the limit: a lease's used units are re-scored to their
      -- times, so near the limit a hot key is still admitted from leases
      -- as fast as room frees up (per request there, a key at its limit
      -- refilled too slowly: docs/PERFORMANCE.md, "Quota leases"); not
      -- below 4 units (the last 8 of the limit are decided per request).
      -- Worker shares stay out of the last quarter (the daemon's rule).
      local room = limit - count - cost
      if room >= 8 then
        granted = math.min(want, math.floor(room / 2))
      end
    end
    if cost == 1 then
      redis.call('ZADD', key, now, member)
    else
      units({ 'ZADD', key }, now, member .. ':', 1, cost)
    end
    if granted > 0 then
      units({ 'ZADD', key }, now + life, base .. '.l', 1, granted)
    end
    admitted = true
    count = count + cost
    -- The newest admission leaves the window exactly `window` ms from now.
    answer(out, 1, count + granted, limit - count - granted, 0, window)
  else
    -- Denied: the request fits once the (count + cost - limit) oldest
    -- admissions have left.
    local retry_after, reset = log_wait(key, window, now, count, cost, limit)
    answer(out, 0, count, math.max(limit - count, 0), retry_after, reset)
  end
  -- Once per key, after its last request (see "Expiry" above).
  if admitted and (batch or j == n) then
    local ttl = window
    if granted > 0 then
      ttl = window + life
    end
    if fresh then
      redis.call('PEXPIRE', key, ttl)
    else
      redis.call('PEXPIRE', key, ttl, 'GT')
    end
  end
end

if lease then
  out[#out + 1] = granted
  out[#out + 1] = now
end
return out

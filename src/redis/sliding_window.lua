#!lua
-- ratelimitd: exact sliding-window limit, run atomically by Redis.
--
-- The shebang (Redis 7.0 or later) declares a script that may write, with
-- no flags: Redis refuses to start it when used memory is over maxmemory
-- (an OOM error, answered with the request's fail policy). Without it,
-- Redis checks memory only at the script's first write and lets every
-- later one through, so admissions would grow past maxmemory.
--
-- One ZSET per key; score = admission time in ms; member = unique id.
-- An admission at t counts while t > now - window. A request of cost c is
-- admitted whole if count + c <= limit; a denied request records nothing.
--
-- One call judges one request, or a batch of requests for the same key and
-- window that the daemon coalesced while an earlier call for the key was in
-- flight: each in turn, in the order given, exactly as if each had been a
-- call of its own at the same instant (an admitted one counts for the next).
--
-- KEYS[1]  the window key, "<prefix>{<key>}:<window>ms" (one Cluster slot)
-- ARGV[1]  window length in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id, unique per daemon instance and call
-- ARGV[4], ARGV[5]  limit and cost of the first request (1 <= cost <= limit)
-- ARGV[6], ARGV[7]  ... of the second, and so on
-- Returns, per request, {allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms}, all in one flat array.

-- TIME is non-deterministic; scripts with a shebang always replicate their
-- effects, so writes after it are safe.

-- Quota leases (docs/PERFORMANCE.md, "Quota leases"): a daemon that sees a
-- key often reserves units of its quota and admits from them locally.
-- Lease: ARGV[1] 'L', ARGV[2] window, ARGV[3] now (0: Redis TIME), ARGV[4]
-- member base, ARGV[5] limit, ARGV[6] cost, ARGV[7] units wanted, ARGV[8]
-- lease life in ms. The request itself is decided as a single check; if it
-- is admitted, up to min(wanted, floor(room left / 2)) units are reserved as
-- "<base>.l<u>", scored now + life: the latest true time of any admission
-- made from them (the daemon admits from a lease only until life ms after it
-- sent this call), so each unit counts for a full window after the admission
-- it may stand for, settled or not (a daemon killed holding a lease
-- over-admits nothing). Returns {allowed, count, remaining, retry_after_ms,
-- reset_ms, granted, now}; count includes the request and the units, and
-- remaining excludes both.
-- Settle: ARGV[1] 'S', ARGV[2] member base, ARGV[3] units granted, then the
-- score of each used unit (units 1..u in order), 0 for one that keeps the
-- score it was reserved with (used at now + life: every unit a worker
-- shared): used units are re-scored (ZADD XX: never recreated once out of
-- the window), unused ones removed. Returns {rescored, removed}.
-- Mode 'L' runs through the one-key code at the end of this script.
if ARGV[1] == 'S' then
  local key, base, granted = KEYS[1], ARGV[2], tonumber(ARGV[3])
  local used = #ARGV - 3
  local rescored, removed = 0, 0
  local args, m = { 'XX', 'CH' }, 2
  for u = 1, used do
    local score = ARGV[3 + u]
    if score ~= '0' then
      args[m + 1] = score
      args[m + 2] = base .. '.l' .. u
      m = m + 2
    end
    if m >= 1000 or (u == used and m > 2) then
      rescored = rescored + redis.call('ZADD', key, unpack(args, 1, m))
      m = 2
    end
  end
  args, m = {}, 0
  for u = used + 1, granted do
    m = m + 1
    args[m] = base .. '.l' .. u
    if m == 1000 or u == granted then
      removed = removed + redis.call('ZREM', key, unpack(args, 1, m))
      m = 0
    end
  end
  return { rescored, removed }
end

-- Several keys, all or nothing (CHECK_POLICY with several items, or one
-- refundable item; docs/PROTOCOL.md section 4b). KEYS[i] is item i's
-- window key (on a Cluster all in one slot: the daemon groups them).
--   ARGV[1] 'm', ARGV[2] now (0: Redis TIME), ARGV[3] member base,
--   ARGV[4] 0: record, or R > 0: reserve for R ms (one Cluster slot of
--   several),
--   then per key: window, limit, cost, shadow (1|0), item number j.
-- Every key is cleaned and counted first; item i fits if count + cost <=
-- limit. If every non-shadow item fits, each fitting item is recorded as
-- "<base>.<j>" (cost 1) or "<base>.<j>:<u>" per unit; otherwise nothing is.
-- A reservation is recorded with the score now - window + R (when R <
-- window): it leaves the window R ms from now by itself unless confirmed.
-- Returns {committed (1|0), now} then per key {fits, count, remaining,
-- retry_after_ms, reset_ms}: with ARGV[4] 0 and committed, count after this
-- request; otherwise the window as it stands without this request (a
-- reservation's numbers too: the daemon adds the cost once every slot
-- reserved).
--
-- Confirm: ARGV[1] 'c', ARGV[2] member base, ARGV[3] score (the 'm' call's
-- now), then per key: cost, item number j. The reserved members still there
-- get that score: admissions from then on. Idempotent. Returns the members
-- confirmed.
--
-- Refund: ARGV[1] 'r', ARGV[2] member base, then per key: cost, item
-- number j. ZREM of exactly the members 'm' wrote: idempotent, and a no-op
-- once they have left the window. Returns the members removed.
-- ARGV[1] = 'm', 'c' or 'r' selects these (the single-key check below pays
-- one string comparison for them; no closure is made per call).
if ARGV[1] == 'm' or ARGV[1] == 'r' or ARGV[1] == 'c' then
  if ARGV[1] ~= 'm' then
    local base = ARGV[2]
    local confirm = ARGV[1] == 'c'
    local score = ARGV[3]
    -- The per-key arguments start one later for 'c' (after the score).
    local o = confirm and 1 or 0
    local done = 0
    for i = 1, #KEYS do
      local cost = tonumber(ARGV[1 + o + 2 * i])
      local member = base .. '.' .. ARGV[2 + o + 2 * i]
      if confirm and cost == 1 then
        done = done + redis.call('ZADD', KEYS[i], 'XX', 'CH', score, member)
      elseif confirm then
        local args, m = { 'XX', 'CH' }, 2
        for u = 1, cost do
          args[m + 1] = score
          args[m + 2] = member .. ':' .. u
          m = m + 2
          if m >= 1000 or u == cost then
            done = done + redis.call('ZADD', KEYS[i], unpack(args, 1, m))
            m = 2
          end
        end
      elseif cost == 1 then
        done = done + redis.call('ZREM', KEYS[i], member)
      else
        local args, m = {}, 0
        for u = 1, cost do
          m = m + 1
          args[m] = member .. ':' .. u
          if m == 1000 or u == cost then
            done = done + redis.call('ZREM', KEYS[i], unpack(args, 1, m))
            m = 0
          end
        end
      end
    end
    return done
  end
  local now = tonumber(ARGV[2])
  if now == 0 then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  local base = ARGV[3]
  local reserve = tonumber(ARGV[4])
  local n = #KEYS
  local counts, fits = {}, {}
  local committed = true
  for i = 1, n do
    local a = 5 + 5 * (i - 1)
    local window, limit, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - window)
    counts[i] = redis.call('ZCARD', KEYS[i])
    fits[i] = counts[i] + cost <= limit
    if not fits[i] and ARGV[a + 3] ~= '1' then
      committed = false
    end
  end
  local out = { committed and 1 or 0, now }
  for i = 1, n do
    local a = 5 + 5 * (i - 1)
    local key = KEYS[i]
    local window, limit, cost = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    local count = counts[i]
    local write = fits[i] and committed
    if not write or reserve > 0 then
      -- The window as it stands without this request.
      local retry_after, reset = 0, window
      local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if newest[2] then
        reset = tonumber(newest[2]) + window - now
      end
      if not fits[i] then
        retry_after = window
        local rank = count + cost - limit - 1
        local oldest = redis.call('ZRANGE', key, rank, rank, 'WITHSCORES')
        if oldest[2] then
          retry_after = tonumber(oldest[2]) + window - now
        end
      end
      local remaining = limit - count
      if remaining < 0 then
        remaining = 0
      end
      out[#out + 1] = fits[i] and 1 or 0
      out[#out + 1] = count
      out[#out + 1] = remaining
      out[#out + 1] = retry_after
      out[#out + 1] = reset
    end
    if write then
      local score = now
      if reserve > 0 and reserve < window then
        score = now - window + reserve
      end
      local member = base .. '.' .. ARGV[a + 4]
      if cost == 1 then
        redis.call('ZADD', key, score, member)
      else
        local args, m = {}, 0
        for u = 1, cost do
          args[m + 1] = score
          args[m + 2] = member .. ':' .. u
          m = m + 2
          if m == 1000 or u == cost then
            redis.call('ZADD', key, unpack(args, 1, m))
            m = 0
          end
        end
      end
      -- See "Expiry" below: counts[i] is 0 only for a key this call made.
      if counts[i] == 0 then
        redis.call('PEXPIRE', key, window)
      else
        redis.call('PEXPIRE', key, window, 'GT')
      end
      if reserve == 0 then
        count = count + cost
        out[#out + 1] = 1
        out[#out + 1] = count
        out[#out + 1] = limit - count
        out[#out + 1] = 0
        out[#out + 1] = window
      end
    end
  end
  return out
end

-- Different keys in one call (cold keys queued at the same moment; one
-- Redis, or keys of one Cluster slot): ARGV[1] 'B', ARGV[2] now (0: Redis
-- TIME), ARGV[3] member base, then per key i: window, limit, cost. Each key
-- is decided exactly as a single call of its own at the same instant would
-- (its member "<base>.k<i>", ":<u>" per unit of cost); a key named twice is
-- decided in order, the first admission counting for the second. Returns
-- per key {allowed, count, remaining, retry_after_ms, reset_ms}, flat.
-- Expiry, in every writing path: a key that existed before the call
-- (count > 0 after the clean-up) may hold a lease's units, scored up to
-- life ms ahead and kept by an expiry of now + life + window, so its
-- expiry is only ever extended (PEXPIRE ... GT); a key the call created
-- holds none and has no expiry yet (GT would never set one), so it gets a
-- plain PEXPIRE. One PEXPIRE per admitting call either way, as before
-- leases: no PTTL.

-- One key and window (a single check, a coalesced batch, or mode 'L'), or
-- different keys in one call (mode 'B'): request j is decided on its key
-- exactly as a call of its own at the same instant would decide it.
local key = KEYS[1]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local base = ARGV[3]
local n = (#ARGV - 3) / 2
-- Where request j's fields sit: limit at ARGV[2 + o + s * j], cost next,
-- and in mode 'B' its window just before (a stride s of 3).
local lease, batch, o, s = ARGV[1] == 'L', ARGV[1] == 'B', 0, 2
local want, life = 0, 0
if lease then
  window, now, base, n, o = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], 1, 1
  want, life = tonumber(ARGV[7]), tonumber(ARGV[8])
elseif batch then
  now, base, n, s = tonumber(ARGV[2]), ARGV[3], #KEYS, 3
end

if now == 0 then
  -- One clock for every gateway: the Redis server's, in ms (TIME gives s and us).
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
    if cost == 1 and granted == 0 then
      redis.call('ZADD', key, now, member)
    else
      -- Sent in chunks: unpack() of a very large table overflows Lua's C stack.
      local args, m = {}, 0
      for i = 1, cost + granted do
        if i <= cost then
          args[m + 1] = now
          args[m + 2] = cost == 1 and member or member .. ':' .. i
        else
          args[m + 1] = now + life
          args[m + 2] = base .. '.l' .. (i - cost)
        end
        m = m + 2
        if m == 1000 or i == cost + granted then
          redis.call('ZADD', key, unpack(args, 1, m))
          m = 0
        end
      end
    end
    admitted = true
    count = count + cost
    -- The newest admission leaves the window exactly `window` ms from now.
    out[#out + 1] = 1
    out[#out + 1] = count + granted
    out[#out + 1] = limit - count - granted
    out[#out + 1] = 0
    out[#out + 1] = window
  else
    -- Denied. The request fits once the (count + cost - limit) oldest
    -- admissions have left; the window is empty once the newest has.
    local rank = count + cost - limit - 1
    local oldest = redis.call('ZRANGE', key, rank, rank, 'WITHSCORES')
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    local retry_after = window
    local reset = window
    if oldest[2] then
      retry_after = tonumber(oldest[2]) + window - now
    end
    if newest[2] then
      reset = tonumber(newest[2]) + window - now
    end
    local remaining = limit - count
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = 0
    out[#out + 1] = count
    out[#out + 1] = remaining
    out[#out + 1] = retry_after
    out[#out + 1] = reset
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

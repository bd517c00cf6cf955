#!lua
-- ratelimitd: the penalty box (docs/POLICIES.md, "Penalty box"): a policy's
-- exact sliding-window log (as sliding_window.lua decides one request), with
-- the key's ban checked and its refusals counted in the same atomic call.
--
-- KEYS[1]  the window key, "<prefix>{<key>}:<window>ms" (the log's)
-- KEYS[2]  the ban key, "<prefix>{<key>}:penalty:ban": its value is the
--          ban's end (Unix ms, the script's clock), its PTTL what is left
-- KEYS[3]  the strike key, "<prefix>{<key>}:penalty:strikes": a ZSET of
--          the key's refusals within the penalty's `within`, by time
-- (all three in the key's Cluster slot)
-- ARGV[1]  window length in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id, unique per daemon instance and call
-- ARGV[4], ARGV[5]  limit and cost (1 <= cost <= limit)
-- ARGV[6]  after: refusals within `within` that engage a ban
-- ARGV[7]  within, ms
-- ARGV[8]  ban, ms
-- Returns {allowed (1|0), count, remaining, retry_after_ms, reset_ms,
-- banned_ms, engaged}: banned_ms > 0 while the key is banned (the request
-- was refused for it, nothing recorded; retry_after_ms is the ban's end);
-- engaged: the ban's end (Unix ms) when this refusal engaged it, else 0.
--
-- A banned key's requests record nothing and are no strikes. A refusal by
-- the window is one strike whatever its cost; the `after`-th strike within
-- `within` sets the ban (SET PX ban) and clears the strikes.
--@include parts/units.lua
--@include parts/log_wait.lua
local key, bankey, strikes = KEYS[1], KEYS[2], KEYS[3]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local member = ARGV[3]
local limit, cost = tonumber(ARGV[4]), tonumber(ARGV[5])
local after, within, ban = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])

--@include parts/now.lua

redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
local count = redis.call('ZCARD', key)

local left = redis.call('PTTL', bankey)
if left > 0 then
  return { 0, count, 0, left, left, left, 0 }
end

if count + cost <= limit then
  if cost == 1 then
    redis.call('ZADD', key, now, member)
  else
    units({ 'ZADD', key }, now, member .. ':', 1, cost)
  end
  if redis.call('PTTL', key) < window then
    redis.call('PEXPIRE', key, window)
  end
  count = count + cost
  return { 1, count, limit - count, 0, window, 0, 0 }
end

-- Refused by the window: as sliding_window.lua answers it.
local retry_after, reset = log_wait(key, window, now, count, cost, limit)
local remaining = math.max(limit - count, 0)

-- One strike.
redis.call('ZREMRANGEBYSCORE', strikes, '-inf', now - within)
redis.call('ZADD', strikes, now, member)
if redis.call('ZCARD', strikes) >= after then
  redis.call('DEL', strikes)
  redis.call('SET', bankey, now + ban, 'PX', ban)
  if reset < ban then
    reset = ban
  end
  return { 0, count, 0, ban, reset, ban, now + ban }
end
redis.call('PEXPIRE', strikes, within)
return { 0, count, remaining, retry_after, reset, 0, 0 }

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
local key, bankey, strikes = KEYS[1], KEYS[2], KEYS[3]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local member = ARGV[3]
local limit, cost = tonumber(ARGV[4]), tonumber(ARGV[5])
local after, within, ban = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])

if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

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
    -- Sent in chunks: unpack() of a very large table overflows Lua's C stack.
    local args, m = {}, 0
    for i = 1, cost do
      args[m + 1] = now
      args[m + 2] = member .. ':' .. i
      m = m + 2
      if m == 1000 or i == cost then
        redis.call('ZADD', key, unpack(args, 1, m))
        m = 0
      end
    end
  end
  if redis.call('PTTL', key) < window then
    redis.call('PEXPIRE', key, window)
  end
  count = count + cost
  return { 1, count, limit - count, 0, window, 0, 0 }
end

-- Refused by the window: as sliding_window.lua answers it.
local rank = count + cost - limit - 1
local oldest = redis.call('ZRANGE', key, rank, rank, 'WITHSCORES')
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
local retry_after, reset = window, window
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

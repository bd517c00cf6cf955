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
-- KEYS[1]  the window key, "<prefix>{<key>}:<window>ms" (one Cluster slot)
-- ARGV[1]  limit: admissions allowed per window (1 <= limit)
-- ARGV[2]  window length in ms
-- ARGV[3]  cost: 1 <= cost <= limit
-- ARGV[4]  member id, unique per daemon instance and request
-- ARGV[5]  now in ms from the caller's clock, or 0 to use Redis TIME
-- Returns {allowed (1|0), count, remaining, retry_after_ms, reset_ms}

-- TIME is non-deterministic; scripts with a shebang always replicate their
-- effects, so writes after it are safe.

local key = KEYS[1]
local limit = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local member = ARGV[4]
local now = tonumber(ARGV[5])

if now == 0 then
  -- One clock for every gateway: the Redis server's, in ms (TIME gives s and us).
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
local count = redis.call('ZCARD', key)

if count + cost <= limit then
  if cost == 1 then
    redis.call('ZADD', key, now, member)
  else
    -- Sent in chunks: unpack() of a very large table overflows Lua's C stack.
    local args, n = {}, 0
    for i = 1, cost do
      args[n + 1] = now
      args[n + 2] = member .. ':' .. i
      n = n + 2
      if n == 1000 or i == cost then
        redis.call('ZADD', key, unpack(args, 1, n))
        n = 0
      end
    end
  end
  -- The newest admission leaves the window exactly `window` ms from now.
  redis.call('PEXPIRE', key, window)
  count = count + cost
  return {1, count, limit - count, 0, window}
end

-- Denied. The request fits once the (count + cost - limit) oldest admissions
-- have left; the window is empty once the newest has.
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
return {0, count, remaining, retry_after, reset}

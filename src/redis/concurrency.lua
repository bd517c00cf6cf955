#!lua
-- ratelimitd: concurrency limits (at most `limit` requests in flight per
-- key, across every host), run atomically by Redis. One ZSET per key: a
-- member per lease (the client's lease id), scored with the time the lease
-- expires. A lease not released (a crashed nginx, a lost release) stops
-- counting when it expires: no slot leaks for longer than the lease.
--
-- KEYS[1]  the key (one Cluster slot; never another algorithm's key)
-- ARGV[1]  "acquire" or "release"
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  the lease id (scoped by the caller)
-- ARGV[4]  limit (acquire)
-- ARGV[5]  lease length in ms (acquire)
-- ARGV[6]  cost: slots the request takes (acquire; 1 <= cost <= limit)
-- Returns {allowed (1|0), count, remaining, retry_after_ms, reset_ms}:
--   acquire: allowed iff in-flight + cost <= limit; count in flight after;
--            refused: retry = ms until the earliest lease expires (an upper
--            bound: a release can come sooner); reset = the lease length
--            (admitted) or ms until every lease has expired (refused)
--   release: allowed 1 if the lease was held, 0 if not (expired, or
--            released already); count in flight after; retry 0; reset 0

local key = KEYS[1]
local mode = ARGV[1]
local now = tonumber(ARGV[2])
local lease = ARGV[3]

if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', now)

if mode == 'release' then
  -- A lease of cost c is c members: lease, lease#2, ..., lease#c.
  local removed = redis.call('ZREM', key, lease)
  if removed == 1 then
    local k = 2
    while redis.call('ZREM', key, lease .. '#' .. k) == 1 do
      k = k + 1
    end
  end
  local count = redis.call('ZCARD', key)
  return {removed, count, 0, 0, 0}
end

local limit = tonumber(ARGV[4])
local lease_ms = tonumber(ARGV[5])
local cost = tonumber(ARGV[6])
local count = redis.call('ZCARD', key)
if count + cost <= limit then
  redis.call('ZADD', key, now + lease_ms, lease)
  for k = 2, cost do
    redis.call('ZADD', key, now + lease_ms, lease .. '#' .. k)
  end
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, tonumber(newest[2]))
  count = count + cost
  return {1, count, limit - count, 0, lease_ms}
end
local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
local remaining = limit - count
if remaining < 0 then
  remaining = 0
end
return {0, count, remaining, tonumber(oldest[2]) - now, tonumber(newest[2]) - now}

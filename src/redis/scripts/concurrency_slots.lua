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
--   acquire: allowed iff in-flight + cost <= limit, where a lease id the
--            key holds already is renewed: its own slots are not counted,
--            and on admission replaced by `cost` slots expiring at
--            now + lease_ms (a refused renewal leaves it as it was);
--            count in flight after;
--            refused: retry = ms until the earliest lease expires (an upper
--            bound: a release can come sooner); reset = the lease length
--            (admitted) or ms until every lease has expired (refused)
--   release: allowed 1 if the lease was held, 0 if not (expired, or
--            released already); count in flight after; retry 0; reset 0

local key = KEYS[1]
local mode = ARGV[1]
local now = tonumber(ARGV[2])
local lease = ARGV[3]

--@include parts/now.lua

redis.call('ZREMRANGEBYSCORE', key, '-inf', now)

-- A lease of cost c is c members: lease, lease#2, ..., lease#c. The
-- slots the lease holds (0 when it is not held).
local function held()
  if not redis.call('ZSCORE', key, lease) then
    return 0
  end
  local k = 1
  while redis.call('ZSCORE', key, lease .. '#' .. (k + 1)) do
    k = k + 1
  end
  return k
end

local function remove(k)
  redis.call('ZREM', key, lease)
  for j = 2, k do
    redis.call('ZREM', key, lease .. '#' .. j)
  end
end

if mode == 'release' then
  local k = held()
  remove(k)
  local removed = 0
  if k > 0 then
    removed = 1
  end
  local count = redis.call('ZCARD', key)
  return {removed, count, 0, 0, 0}
end

local limit = tonumber(ARGV[4])
local lease_ms = tonumber(ARGV[5])
local cost = tonumber(ARGV[6])
local own = held()
local count = redis.call('ZCARD', key) - own
if count + cost <= limit then
  remove(own)
  redis.call('ZADD', key, now + lease_ms, lease)
  for k = 2, cost do
    redis.call('ZADD', key, now + lease_ms, lease .. '#' .. k)
  end
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, tonumber(newest[2]))
  count = count + cost
  return {1, count, limit - count, 0, lease_ms}
end
-- Refused: the lease held, if any, stays as it was and counts.
count = count + own
local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
local remaining = limit - count
if remaining < 0 then
  remaining = 0
end
return {0, count, remaining, tonumber(oldest[2]) - now, tonumber(newest[2]) - now}

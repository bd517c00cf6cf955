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

local key = KEYS[1]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local base = ARGV[3]
local n = (#ARGV - 3) / 2

if now == 0 then
  -- One clock for every gateway: the Redis server's, in ms (TIME gives s and us).
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
local count = redis.call('ZCARD', key)
local out = {}
local admitted = false

for j = 1, n do
  local limit = tonumber(ARGV[2 + 2 * j])
  local cost = tonumber(ARGV[3 + 2 * j])
  -- Members stay unique across the batch: "<base>" alone for a lone
  -- request, "<base>.<j>" for the j-th of a batch; ":<i>" per unit of cost.
  local member = base
  if n > 1 then
    member = base .. '.' .. j
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
    admitted = true
    count = count + cost
    -- The newest admission leaves the window exactly `window` ms from now.
    out[#out + 1] = 1
    out[#out + 1] = count
    out[#out + 1] = limit - count
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
end

if admitted then
  redis.call('PEXPIRE', key, window)
end
return out

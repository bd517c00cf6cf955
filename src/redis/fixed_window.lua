#!lua
-- ratelimitd: the fixed window, run atomically by Redis. Same arguments and
-- reply layout as sliding_window.lua. O(1) memory: one string per key,
-- "<window start> <count>".
--
-- Windows are aligned to multiples of the window length since the Unix
-- epoch, which is midnight UTC: a window of 60000, 3600000 or 86400000 ms
-- is a UTC minute, hour or day (quotas that reset on the minute, the hour,
-- or at midnight UTC). A request of cost c is admitted iff count + c <=
-- limit; the count starts at 0 in each window.
--
-- Replies, per request, {allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms}: count and remaining in the current window; reset_ms the time
-- until the window ends (the real reset, what the headers report);
-- retry_after_ms 0 when admitted, else reset_ms (the next window takes any
-- cost up to the limit). Counts only grow inside a window, so a refusal
-- holds until the reset: the denial cache is exact for it.
--
-- It admits up to 2 x limit in any sliding window of its length (a full
-- window's end and the next one's start): see docs/ALGORITHMS.md.
--
-- KEYS[1]  the key (one Cluster slot; never another algorithm's key)
-- ARGV[1]  window length W in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id (unused; kept so every script takes the same arguments)
-- ARGV[4], ARGV[5]  limit and cost of the first request, and so on

local key = KEYS[1]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local n = (#ARGV - 3) / 2

if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local start = now - now % window
local reset = start + window - now
local count = 0
local stored = redis.call('GET', key)
if stored then
  local s, c = string.match(stored, '^(%d+) (%d+)$')
  if tonumber(s) == start then
    count = tonumber(c)
  end
end

local changed = false
local out = {}
for j = 1, n do
  local limit = tonumber(ARGV[2 + 2 * j])
  local cost = tonumber(ARGV[3 + 2 * j])
  if count + cost <= limit then
    count = count + cost
    changed = true
    out[#out + 1] = 1
    out[#out + 1] = count
    out[#out + 1] = limit - count
    out[#out + 1] = 0
    out[#out + 1] = reset
  else
    local remaining = limit - count
    if remaining < 0 then
      remaining = 0
    end
    out[#out + 1] = 0
    out[#out + 1] = count
    out[#out + 1] = remaining
    out[#out + 1] = reset
    out[#out + 1] = reset
  end
end

if changed then
  redis.call('SET', key, string.format('%d %d', start, count), 'PX', reset)
end
return out

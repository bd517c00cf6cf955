#!lua
-- ratelimitd: the sliding-window counter, run atomically by Redis. Same
-- arguments and reply layout as sliding_window.lua. O(1) memory whatever
-- the limit and window (hours, days): one string per key,
-- "<current window start> <current count> <previous count>".
--
-- Fixed windows aligned to multiples of W since the Unix epoch; the count
-- of the sliding window ending now is estimated as the previous fixed
-- window's count weighted by the part of it still inside the sliding
-- window, plus the current one's:
--   estimate = prev * (W - e) / W + cur,   e = now - start of current
-- A request of cost c is admitted iff estimate + c <= limit. The estimate
-- assumes the previous window's admissions were spread evenly: it can
-- admit more than the limit in some sliding window (bursts at window
-- edges) or less; docs/ALGORITHMS.md has the measured bounds.
--
-- Replies, per request, {allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms}:
--   count      ceil(estimate), after the request when admitted
--   remaining  max(limit - count, 0)
--   retry      0 when admitted; else ms until estimate + c <= limit if
--              nothing else is admitted (the first whole ms)
--   reset      ms until the estimate is 0: the end of the next window if
--              the current one has admissions, else of the current one
-- With no admissions the estimate never grows, so a refusal holds until
-- its retry-after: the denial cache is exact for it.
--
-- KEYS[1]  the key (one Cluster slot; never another algorithm's key)
-- ARGV[1]  window length W in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id (unused; kept so every script takes the same arguments),
--          or 'r' (reserve) or 's' (settle), docs/PROTOCOL.md 4f:
--   'r': one request; when admitted, KEYS[2] (the settle record) is set to
--        "<window start> <cost>" for SETTLE_LIFE ms.
--   's': ARGV[4], ARGV[5] the limit and the actual cost. KEYS[2] read and
--        deleted; none: reply {0, ...} (nothing changes). A surplus is
--        taken off the count of the window the reservation was counted in
--        (current or previous; older: gone with it), a shortfall added to
--        the current window's count, which may pass the limit (debt:
--        refused while the weighted estimate is above the limit; a debt
--        above one window's limit is forgotten after two windows, as the
--        algorithm forgets every count).
-- ARGV[4], ARGV[5]  limit and cost of the first request, and so on

local key = KEYS[1]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local n = (#ARGV - 3) / 2

--@include parts/now.lua
--@include parts/answer.lua
--@include parts/each_request.lua

local start = now - now % window
local elapsed = now - start
local cur, prev = 0, 0
local stored = redis.call('GET', key)
if stored then
  local s, c, p = string.match(stored, '^(%d+) (%d+) (%d+)$')
  s = tonumber(s)
  if s == start then
    cur, prev = tonumber(c), tonumber(p)
  elseif s == start - window then
    prev = tonumber(c)
  end
end

local EPS = 1e-9
--@include parts/settle_mode.lua

if mode == 's' then
--@include sliding_counter/counter_settle.lua
end

-- The first whole ms (from now) at which prev * (W - e) / W + cur + cost
-- <= limit, with nothing else admitted.
local function retry_after(limit, cost)
  local room = limit - cur - cost
  if room >= 0 then
    -- Within this window: e >= W - room * W / prev (prev > 0 here).
    local e = window - room * window / prev
    return math.max(1, math.ceil(e - EPS) - elapsed)
  end
  -- Next window: the current count becomes the previous one.
  local to_next = window - elapsed
  local room_next = limit - cost
  local e = window - room_next * window / cur
  if e < 0 then
    e = 0
  end
  return to_next + math.ceil(e - EPS)
end

local changed = false
local out = each_request(n, function(limit, cost)
  local weighted = prev * (window - elapsed) / window
  if weighted + cur + cost <= limit + EPS then
    cur = cur + cost
    changed = true
    if mode == 'r' then
      redis.call('SET', KEYS[2], string.format('%d %d', start, cost), 'PX', SETTLE_LIFE)
    end
    local count = math.ceil(weighted + cur - EPS)
    return 1, count, math.max(limit - count, 0), 0, 2 * window - elapsed
  end
  local count = math.ceil(weighted + cur - EPS)
  local reset = window - elapsed
  if cur > 0 then
    reset = reset + window
  end
  return 0, count, math.max(limit - count, 0), retry_after(limit, cost), reset
end)

if changed then
  redis.call('SET', key, string.format('%d %d %d', start, cur, prev), 'PX', 2 * window - elapsed)
end
return out

#!lua
-- ratelimitd: the fixed window, run atomically by Redis. Same arguments and
-- reply layout as sliding_window.lua. O(1) memory: one string per key,
-- "<window start> <count>".
--
-- Windows are aligned to multiples of the window length since the Unix
-- epoch, which is midnight UTC: a window of 60000, 3600000 or 86400000 ms
-- is a UTC minute, hour or day (quotas that reset on the minute, the hour,
-- or at midnight UTC). A window_ms of CALENDAR or above (src/window.rs) is
-- a calendar month or a window aligned to a fixed UTC offset. A request of cost c is admitted iff count + c <=
-- limit; the count starts at 0 in each window.
--
-- Replies, per request, {allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms}: count and remaining in the current window; reset_ms the time
-- until the window ends (the real reset, what the headers report);
-- retry_after_ms 0 when admitted, else the start of the first window that
-- takes the cost: the reset, or, in debt, the window the debt leaves room
-- in (debt_end, below). Counts only grow inside a window, so a refusal
-- holds until then: the denial cache is exact for it.
--
-- It admits up to 2 x limit in any sliding window of its length (a full
-- window's end and the next one's start): see docs/ALGORITHMS.md.
--
-- KEYS[1]  the key (one Cluster slot; never another algorithm's key)
-- ARGV[1]  window length W in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id (unused; kept so every script takes the same arguments),
--          or 'r' (reserve) or 's' (settle), docs/PROTOCOL.md 4f:
--   'r': one request; when admitted, KEYS[2] (the settle record) is set to
--        "<window start> <cost>" for SETTLE_LIFE ms.
--   's': ARGV[4], ARGV[5] the limit and the actual cost. KEYS[2] read and
--        deleted; none: reply {0, ...} (forged, replayed, expired: nothing
--        changes). Else the count moves by actual - estimate if the
--        reservation's window is this one; from an earlier window only a
--        shortfall is charged (the surplus left with its window). The count
--        may pass the limit: the excess is debt.
-- Debt: a count above the limit refuses every cost; k windows later the
-- count starts at count - k limit instead of 0 (the key lives until then),
-- so a shortfall is paid out of the following windows' limits, exactly.
-- ARGV[4], ARGV[5]  limit and cost of the first request, and so on

local key = KEYS[1]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local n = (#ARGV - 3) / 2

--@include parts/now.lua
--@include parts/answer.lua
--@include parts/each_request.lua

--@include parts/calendar.lua

local start, stop
-- Windows between two starts (debt, below): a calendar month's count, or
-- the fixed length's.
local month_offset, length = nil, window
if window >= 3221225472 then
  -- CALENDAR (0xC0000000) + minutes * 4096 + offset minutes + 2048: a
  -- window of whole minutes (0: a calendar month) at a UTC offset.
  local code = window - 3221225472
  local minutes = math.floor(code / 4096)
  local offset = (code % 4096 - 2048) * 60000
  local day = 86400000
  local loc = now + offset
  if minutes > 0 then
    local w = minutes * 60000
    start = loc - loc % w
    stop = start + w
    length = w
  else
    month_offset = offset
    local y, m = civil_from_days(math.floor(loc / day))
    start = days_from_civil(y, m, 1) * day
    if m == 12 then
      stop = days_from_civil(y + 1, 1, 1) * day
    else
      stop = days_from_civil(y, m + 1, 1) * day
    end
  end
  start = start - offset
  stop = stop - offset
else
  start = now - now % window
  stop = start + window
end
local reset = stop - now
--@include parts/settle_mode.lua
local first_limit = tonumber(ARGV[4])
local count = 0
local stored = redis.call('GET', key)
if stored then
  local s, c = string.match(stored, '^(%d+) (%d+)$')
  s, c = tonumber(s), tonumber(c)
  if s == start then
    count = c
  elseif s < start and c > first_limit then
    -- Debt (only a settle makes a count pass the limit): each window since
    -- paid one limit of it.
    local k
    if month_offset then
      local y1, m1 = civil_from_days(math.floor((s + month_offset) / 86400000))
      local y2, m2 = civil_from_days(math.floor((start + month_offset) / 86400000))
      k = (y2 - y1) * 12 + (m2 - m1)
    else
      k = math.floor((start - s) / length)
    end
    count = math.max(c - k * first_limit, 0)
  end
end

-- When (ms from now) a cost fits again after a refusal at count c: the
-- next window, unless debt carries into it (c > limit): k windows on it
-- starts at c - k limit (above), so the first window with room for cost
-- is k = ceil((c + cost - limit) / limit) (at least 1). A month's end is
-- counted on the calendar.
local function debt_end(c, cost, limit)
  local k = 1
  if c > limit then
    k = math.max(1, math.ceil((c + cost - limit) / limit))
  end
  if not month_offset then
    return reset + (k - 1) * length
  end
  local day = 86400000
  local y, m = civil_from_days(math.floor((start + month_offset) / day))
  m = m + k
  y = y + math.floor((m - 1) / 12)
  m = (m - 1) % 12 + 1
  return days_from_civil(y, m, 1) * day - month_offset - now
end

-- How long the key must live: to the reset, or while debt is left, as
-- many windows more as the debt needs to be paid.
local function life(c, limit)
  if c <= limit then
    return reset
  end
  -- A month: the longest one's length, so no later month ends it early.
  local span = month_offset and 2678400000 or (stop - start)
  return reset + math.ceil((c - limit) / limit) * span
end

if mode == 's' then
--@include fixed_window/fixed_settle.lua
end

local changed = false
local out = each_request(n, function(limit, cost)
  if count + cost > limit then
    return 0, count, math.max(limit - count, 0), debt_end(count, cost, limit), reset
  end
  count = count + cost
  changed = true
  if mode == 'r' then
    redis.call('SET', KEYS[2], string.format('%d %d', start, cost), 'PX', SETTLE_LIFE)
  end
  return 1, count, limit - count, 0, reset
end)

if changed then
  redis.call('SET', key, string.format('%d %d', start, count), 'PX', life(count, first_limit))
end
return out

-- Mode 'm': several keys, all or nothing (CHECK_POLICY with several items,
-- or one refundable item; docs/PROTOCOL.md section 4b). KEYS[i] is item
-- i's window key (on a Cluster all in one slot: the daemon groups them).
--   ARGV[1] 'm', ARGV[2] now (0: Redis TIME), ARGV[3] member base,
--   ARGV[4] 0: record, or R > 0: reserve for R ms (one Cluster slot of
--   several),
--   then per key: window, limit, cost, shadow (1|0), item number j.
-- Every key is cleaned and counted first; item i fits if count + cost <=
-- limit. If every non-shadow item fits, each fitting item is recorded as
-- "<base>.<j>" (cost 1) or "<base>.<j>:<u>" per unit; otherwise nothing is.
-- A reservation is recorded with the score now - window + R (when R <
-- window): it leaves the window R ms from now by itself unless confirmed
-- (sliding_window/confirm_refund.lua).
-- Returns {committed (1|0), now} then per key {fits, count, remaining,
-- retry_after_ms, reset_ms}: with ARGV[4] 0 and committed, count after this
-- request; otherwise the window as it stands without this request (a
-- reservation's numbers too: the daemon adds the cost once every slot
-- reserved).
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
    local retry_after, reset = log_wait(key, window, now, count, cost, limit)
    answer(out, fits[i] and 1 or 0, count, math.max(limit - count, 0), retry_after, reset)
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
      units({ 'ZADD', key }, score, member .. ':', 1, cost)
    end
    -- See "Expiry" in sliding_window/per_request.lua: counts[i] is 0 only for a
    -- key this call made.
    if counts[i] == 0 then
      redis.call('PEXPIRE', key, window)
    else
      redis.call('PEXPIRE', key, window, 'GT')
    end
    if reserve == 0 then
      count = count + cost
      answer(out, 1, count, limit - count, 0, window)
    end
  end
end
return out

-- Modes 'c' and 'r': the second step of an all-or-nothing reserve
-- (sliding_window/all_or_nothing.lua) on every key it wrote.
-- Confirm: ARGV[1] 'c', ARGV[2] member base, ARGV[3] score (the 'm' call's
-- now), then per key: cost, item number j. The reserved members still there
-- get that score: admissions from then on. Idempotent. Returns the members
-- confirmed.
-- Refund: ARGV[1] 'r', ARGV[2] member base, then per key: cost, item
-- number j. ZREM of exactly the members 'm' wrote: idempotent, and a no-op
-- once they have left the window. Returns the members removed.
local base = ARGV[2]
local confirm = mode == 'c'
local score = ARGV[3]
-- The per-key arguments start one later for 'c' (after the score).
local o = confirm and 1 or 0
local done = 0
for i = 1, #KEYS do
  local cost = tonumber(ARGV[1 + o + 2 * i])
  local member = base .. '.' .. ARGV[2 + o + 2 * i]
  if confirm and cost == 1 then
    done = done + redis.call('ZADD', KEYS[i], 'XX', 'CH', score, member)
  elseif confirm then
    done = done + units({ 'ZADD', KEYS[i], 'XX', 'CH' }, score, member .. ':', 1, cost)
  elseif cost == 1 then
    done = done + redis.call('ZREM', KEYS[i], member)
  else
    done = done + units({ 'ZREM', KEYS[i] }, nil, member .. ':', 1, cost)
  end
end
return done

-- Mode 'S', a quota lease's settle: ARGV[2] member base, ARGV[3] units
-- granted, then the score of each used unit (units 1..u in order), 0 for
-- one that keeps the score it was reserved with (used at now + life: every
-- unit a worker shared): used units are re-scored (ZADD XX: never
-- recreated once out of the window), unused ones removed. Returns
-- {rescored, removed}.
local key, base, granted = KEYS[1], ARGV[2], tonumber(ARGV[3])
local prefix, text = base .. '.l', unit_text()
local used = #ARGV - 3
local rescored = 0
-- Each used unit has a score of its own: units() sends one score for all.
local args, m = { 'XX', 'CH' }, 2
for u = 1, used do
  local score = ARGV[3 + u]
  if score ~= '0' then
    args[m + 1] = score
    args[m + 2] = prefix .. (text[u] or u)
    m = m + 2
  end
  if m >= 1000 or (u == used and m > 2) then
    rescored = rescored + redis.call('ZADD', key, unpack(args, 1, m))
    m = 2
  end
end
local removed = 0
if granted > used then
  removed = units({ 'ZREM', key }, nil, prefix, used + 1, granted)
end
return { rescored, removed }

#!lua
-- A fixed window's or sliding counter's reset (fixed_window.lua,
-- sliding_counter.lua): the count becomes what the reservations still
-- outstanding on it hold, each read from its settle record (KEYS[2..],
-- "<window start> <cost>"): a quota lease of these algorithms is such a
-- reservation, admitted from with no Redis call and given back by its
-- settle, so its units must stay counted (the reset would otherwise admit
-- past the limit: 206 of 200 with one lease). ARGV[1] the window length
-- (a sliding counter's previous window is one length earlier), ARGV[2]
-- 'f' or 's' (the layout), ARGV[3] 'set' (the reset) or 'add' (records
-- found after it: added, which may count one twice, never none). The key
-- keeps its expiry. Returns {windows touched, units kept}.
local stored = redis.call('GET', KEYS[1])
if not stored then return { 0, 0 } end
local start, cur, prev = string.match(stored, '^(%d+) (%d+) ?(%d*)')
start = tonumber(start)
local window, sliding, add = tonumber(ARGV[1]), ARGV[2] == 's', ARGV[3] == 'add'
local kept_cur, kept_prev = 0, 0
if add then
  kept_cur, kept_prev = tonumber(cur), tonumber(prev) or 0
end
local kept = 0
for i = 2, #KEYS do
  local s, c = string.match(redis.call('GET', KEYS[i]) or '', '^(%d+) (%d+)')
  s, c = tonumber(s), tonumber(c)
  if s == start then
    kept_cur, kept = kept_cur + c, kept + c
  elseif sliding and s == start - window then
    kept_prev, kept = kept_prev + c, kept + c
  end
end
if kept_cur + kept_prev == 0 then
  redis.call('DEL', KEYS[1])
elseif sliding then
  redis.call('SET', KEYS[1], start .. ' ' .. kept_cur .. ' ' .. kept_prev, 'KEEPTTL')
else
  redis.call('SET', KEYS[1], start .. ' ' .. kept_cur, 'KEEPTTL')
end
return { 1, kept }

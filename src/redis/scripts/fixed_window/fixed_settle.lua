-- Mode 's', a reservation's settle (the header of fixed_window.lua).
local actual = tonumber(ARGV[5])
local function reply(ok)
  local left = first_limit - count
  if left < 0 then
    left = 0
  end
  return {ok, count, left, count >= first_limit and debt_end(count, 1, first_limit) or 0, reset}
end
--@include parts/settle_record.lua
local rs, est = string.match(rec, '^(%d+) (%d+)$')
rs, est = tonumber(rs), tonumber(est)
if rs == start or actual > est then
  count = count + actual - est
end
if count < 0 then
  count = 0
end
redis.call('SET', key, string.format('%d %d', start, count), 'PX', life(count, first_limit))
return reply(1)

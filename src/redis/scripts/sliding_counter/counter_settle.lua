-- Mode 's', a reservation's settle (the header of sliding_counter.lua).
local limit = tonumber(ARGV[4])
local actual = tonumber(ARGV[5])
local function reply(ok)
  local count = math.ceil(prev * (window - elapsed) / window + cur - EPS)
  local left = limit - count
  if left < 0 then
    left = 0
  end
  return {ok, count, left, 0, 2 * window - elapsed}
end
--@include parts/settle_record.lua
local rs, est = string.match(rec, '^(%d+) (%d+)$')
rs, est = tonumber(rs), tonumber(est)
if actual >= est then
  cur = cur + actual - est
elseif rs == start then
  cur = math.max(cur - (est - actual), 0)
elseif rs == start - window then
  prev = math.max(prev - (est - actual), 0)
end
redis.call('SET', key, string.format('%d %d %d', start, cur, prev), 'PX', 2 * window - elapsed)
return reply(1)

-- The admin change log (src/admin_api/changes.rs).
-- A reader's step, with Redis's time (ms) first. KEYS[1] the log; ARGV[1]
-- and ARGV[2] the reader's position (its last entry's number and the
-- entry; 0 and '' when its last read found no log), ARGV[3] '1' when it
-- has a position, '0' when it knows nothing. Returns {now, 1, {entry,
-- number, ...}}: the entries after the position; or {now, 0, {top entry,
-- its number}} ({} without a log): the position is gone, reread
-- everything, then stand at the top. A read writes nothing: an idle
-- daemon leaves no key behind.
local now = 0
--@include parts/now.lua
local last = tonumber(ARGV[1])
if ARGV[3] == '1' then
  if ARGV[2] == '' then
    local first = redis.call('ZRANGE', KEYS[1], 1, 1, 'WITHSCORES')
    if redis.call('EXISTS', KEYS[1]) == 0 or tonumber(first[2]) == 1 then
      return { now, 1, redis.call('ZRANGEBYSCORE', KEYS[1], '(0', '+inf', 'WITHSCORES') }
    end
  elseif redis.call('ZRANGEBYSCORE', KEYS[1], last, last)[1] == ARGV[2] then
    return { now, 1, redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. last, '+inf', 'WITHSCORES') }
  end
end
return { now, 0, redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES') }

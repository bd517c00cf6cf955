-- The admin change log (src/admin_api/changes.rs).
-- Appends an entry; its number. KEYS[1] the log; ARGV[1] the entry,
-- ARGV[2] the entries kept, ARGV[3] an epoch marker for a log without one.
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if not redis.call('ZRANGEBYSCORE', KEYS[1], 0, 0)[1] then
  redis.call('ZADD', KEYS[1], 0, ARGV[3])
end
local seq = (tonumber(top[2]) or 0) + 1
redis.call('ZADD', KEYS[1], seq, ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[1], 1, -(tonumber(ARGV[2]) + 1))
return seq

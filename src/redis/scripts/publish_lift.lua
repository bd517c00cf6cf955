-- A ban's lift, appended to the lifts key KEYS[1] (a ZSET, scored by
-- sequence number) with the next number: ARGV[1] the scoped key lifted,
-- ARGV[2] how many lifts to keep (the newest). Returns the number given.
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local seq = (tonumber(top[2]) or 0) + 1
redis.call('ZADD', KEYS[1], seq, ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[2]) + 1))
return seq

#!lua
-- A log window's reset (src/redis/scripts/sliding_window.lua): every admission is
-- forgotten, but not the members scored after Redis's now. Those are
-- units some daemon or nginx worker may still admit from (a quota lease's
-- or a worker share's, scored `t0 + life`) or a reservation not yet
-- settled: deleting them would let their holders admit past the limit
-- (they admit with no Redis call) and make their settle a no-op (`ZADD
-- XX`), so Redis's record would not even show it. They leave as they
-- would have: settled, or at their score plus the window. Their holders
-- forget the admissions before `now` (src/decision/lease.rs
-- `forget_before`), told of it by the change log. Returns {members
-- removed, members kept, now}.
local now = 0
--@include parts/now.lua
local removed = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return { removed, redis.call('ZCARD', KEYS[1]), now }

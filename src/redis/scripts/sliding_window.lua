#!lua
-- ratelimitd: exact sliding-window limit, run atomically by Redis.
--
-- The shebang (Redis 7.0 or later) declares a script that may write, with
-- no flags: Redis refuses to start it when used memory is over maxmemory
-- (an OOM error, answered with the request's fail policy). Without it,
-- Redis checks memory only at the script's first write and lets every
-- later one through, so admissions would grow past maxmemory.
--
-- One ZSET per key; score = admission time in ms; member = unique id.
-- An admission at t counts while t > now - window. A request of cost c is
-- admitted whole if count + c <= limit; a denied request records nothing.
--
-- One call judges one request, or a batch of requests for the same key and
-- window that the daemon coalesced while an earlier call for the key was in
-- flight: each in turn, in the order given, exactly as if each had been a
-- call of its own at the same instant (an admitted one counts for the next).
--
-- KEYS[1]  the window key, "<prefix>{<key>}:<window>ms" (one Cluster slot)
-- ARGV[1]  window length in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id, unique per daemon instance and call
-- ARGV[4], ARGV[5]  limit and cost of the first request (1 <= cost <= limit)
-- ARGV[6], ARGV[7]  ... of the second, and so on
-- Returns, per request, {allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms}, all in one flat array.

-- Modes, by ARGV[1], each in a file of its own (src/redis/scripts/):
--   'S'        a quota lease's settle      sliding_window/lease_settle.lua
--   'c', 'r'   confirm or refund a reserve sliding_window/confirm_refund.lua
--   'm'        several keys, all or nothing sliding_window/all_or_nothing.lua
--   'B', 'L'   cold keys in one call; a quota lease; and the single check
--              above (ARGV[1] the window)   sliding_window/per_request.lua
-- The single check pays one string comparison per mode; no closure is made
-- but the shared parts' functions (parts/*.lua), and no table but its
-- answer's.
local mode = ARGV[1]
--@include parts/units.lua
--@include parts/answer.lua
if mode == 'S' then
--@include sliding_window/lease_settle.lua
end
if mode == 'c' or mode == 'r' then
--@include sliding_window/confirm_refund.lua
end
--@include parts/log_wait.lua
local now = tonumber(ARGV[mode == 'L' and 3 or 2])
--@include parts/now.lua
if mode == 'm' then
--@include sliding_window/all_or_nothing.lua
end
--@include sliding_window/per_request.lua

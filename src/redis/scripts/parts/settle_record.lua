-- The reservation's settle record (KEYS[2]), read and deleted: a settle
-- applies once. None (forged, replayed, expired): the reply says 0 and
-- nothing changes.
local rec = redis.call('GET', KEYS[2])
if not rec then
  return reply(0)
end
redis.call('DEL', KEYS[2])

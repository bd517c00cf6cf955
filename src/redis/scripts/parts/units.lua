-- Runs the command `head` ({'ZADD', key[, flags]} or {'ZREM', key}) on the
-- members prefix .. u for u = first .. last, each at `score` (ZADD; nil for
-- ZREM), sent in chunks of 1000 arguments: unpack() of a very large table
-- overflows Lua's C stack. Returns the sum of Redis's replies. `head` is
-- reused as the argument table.
local function units(head, score, prefix, first, last)
  local fixed = #head
  local m, done = fixed, 0
  for u = first, last do
    if score then
      m = m + 1
      head[m] = score
    end
    m = m + 1
    head[m] = prefix .. u
    if m - fixed >= 1000 or u == last then
      done = done + redis.call(unpack(head, 1, m))
      m = fixed
    end
  end
  return done
end

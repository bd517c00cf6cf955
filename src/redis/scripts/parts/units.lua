-- Member names and scores for a run of units, built without the two
-- number-to-string conversions a unit would otherwise cost: Redis 7.0
-- turns every number argument of redis.call into a string (about 0.4 µs a
-- unit for the score), and `prefix .. u` formats u (about 0.1 µs more).
-- A 64-unit lease call spent 30 of its 138 µs of Redis CPU on them
-- (docs/PERFORMANCE.md, "Redis CPU per decision").
--
-- The text of unit numbers 1..64 (a lease's units, MAX_LEASE_UNITS in
-- src/decision/lease.rs), made by a call that names units and by no other
-- (a single check would pay about 0.3 µs for the table): the name of unit
-- u is prefix .. (text[u] or u).
local function unit_text()
  return {
    '1', '2', '3', '4', '5', '6', '7', '8', '9', '10', '11', '12', '13', '14', '15', '16',
    '17', '18', '19', '20', '21', '22', '23', '24', '25', '26', '27', '28', '29', '30', '31', '32',
    '33', '34', '35', '36', '37', '38', '39', '40', '41', '42', '43', '44', '45', '46', '47', '48',
    '49', '50', '51', '52', '53', '54', '55', '56', '57', '58', '59', '60', '61', '62', '63', '64',
  }
end

-- Runs the command `head` ({'ZADD', key[, flags]} or {'ZREM', key}) on the
-- members prefix .. u for u = first .. last, each at `score` (ZADD; nil for
-- ZREM), sent in chunks of 1000 arguments: unpack() of a very large table
-- overflows Lua's C stack. Returns the sum of Redis's replies. `head` is
-- reused as the argument table. The score is turned into text once, as
-- Redis would turn it ('%.17g': exact for every integer ms).
local function units(head, score, prefix, first, last)
  local fixed = #head
  local m, done, text = fixed, 0, unit_text()
  if score then
    score = string.format('%.17g', score)
  end
  for u = first, last do
    if score then
      m = m + 1
      head[m] = score
    end
    m = m + 1
    head[m] = prefix .. (text[u] or u)
    if m - fixed >= 1000 or u == last then
      done = done + redis.call(unpack(head, 1, m))
      m = fixed
    end
  end
  return done
end

#!lua
-- ratelimitd: the memory-lean exact sliding window ("ring"), run atomically
-- by Redis. Same arguments and reply as sliding_window.lua (the "log"), so
-- coalesced batches work the same way; same decisions as the log (see
-- "Exactness" below), at 8 bytes per admission instead of a ZSET member.
--
-- The key is one string: an 8-byte header, then N slots of 8 bytes, each
-- the time in ms (a double, exact below 2^53) of one admission unit; 0 is
-- an empty slot. The slots form a ring, oldest first from `head` (the
-- header); times are non-decreasing around the ring.
--
-- A request of cost c under limit L is admitted iff count + c <= L, where
-- count is the number of slots inside the window (t > now - window): the
-- same test as the log. Since the slots are sorted, that is "the slot at
-- position N - L + c (oldest first) has left the window", and a refusal's
-- retry-after is that slot's time + window - now: the log's ZRANGE rank
-- count + c - L - 1 among its members names the very same admission.
--
-- N follows use, never beyond the limit: it grows (doubling, at most to L;
-- empty slots at the old end) when an admission finds fewer than c slots
-- outside the window, so a key far below its limit stays small. It shrinks
-- to a smaller limit, keeping the newest L slots, only once the slots it
-- would drop have left the window. Until then the ring keeps them, so a
-- limit lowered and raised again inside one window still sees every
-- admission the log sees. A key at its limit holds 8 + 8 L bytes.
--
-- Exactness: identical to the log while the clock does not go backwards.
-- If it does (a failover to a node whose clock is behind; clock = "local"
-- with hosts out of sync), an admission is stored at the newest slot's time
-- rather than its own, so the ring stays sorted: it then keeps admissions a
-- little longer than the log would (it may refuse where the log admits,
-- never the reverse).
--
-- KEYS[1]  the ring key (one Cluster slot, never the log's key)
-- ARGV[1]  window length in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id (unused: the ring stores times only; kept so both
--          scripts take the same arguments)
-- ARGV[4], ARGV[5]  limit and cost of the first request (1 <= cost <= limit)
-- ARGV[6], ARGV[7]  ... of the second, and so on
-- Returns, per request, {allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms}, all in one flat array.

local key = KEYS[1]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local n = (#ARGV - 3) / 2

--@include parts/now.lua
--@include parts/answer.lua
--@include parts/each_request.lua
local cutoff = now - window

local pack, unpack_d = struct.pack, struct.unpack
local EMPTY = pack('<d', 0)

local size, head = 0, 0
local len = redis.call('STRLEN', key)
if len >= 16 then
  size = (len - 8) / 8
  head = unpack_d('<d', redis.call('GETRANGE', key, 0, 7))
end

-- The time in the k-th slot, oldest first (1 <= k <= size).
local function slot(k)
  local p = (head + k - 1) % size
  return (unpack_d('<d', redis.call('GETRANGE', key, 8 + 8 * p, 15 + 8 * p)))
end

-- Slots inside the window: the sorted ring's first slot past the cutoff,
-- found by bisection (log2(N) reads of 8 bytes).
local function in_window()
  if size == 0 then
    return 0
  end
  local lo, hi = 1, size + 1
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if slot(mid) > cutoff then
      hi = mid
    else
      lo = mid + 1
    end
  end
  return size - lo + 1
end

-- Rewrites the ring as `new_size` slots, oldest first from slot 1, keeping
-- the newest min(size, new_size) and padding the old end with empty slots.
local function resize(new_size)
  local keep = math.min(size, new_size)
  local parts = { pack('<d', 0) }
  local pad = new_size - keep
  if pad > 0 then
    parts[2] = string.rep(EMPTY, pad)
  end
  for k = size - keep + 1, size do
    parts[#parts + 1] = pack('<d', slot(k))
  end
  redis.call('SET', key, table.concat(parts))
  size, head = new_size, 0
end

local count = in_window()
local admitted = false
local newest = 0
if size > 0 then
  newest = slot(size)
end

local out = each_request(n, function(limit, cost)
  if limit < size and slot(size - limit) <= cutoff then
    -- Every slot beyond the newest `limit` has left the window.
    resize(limit)
  end
  if count + cost <= limit then
    if size - count < cost then
      -- Not enough slots outside the window: grow (doubling, capped at
      -- the limit), so a key far below its limit stays small.
      resize(math.min(limit, math.max(count + cost, 2 * size, 8)))
    end
    -- The `cost` oldest slots are outside the window: overwrite them with
    -- this admission, in at most two writes.
    local at = newest
    if now > at then
      at = now
    end
    local rec = pack('<d', at)
    local first = math.min(cost, size - head)
    redis.call('SETRANGE', key, 8 + 8 * head, string.rep(rec, first))
    if cost > first then
      redis.call('SETRANGE', key, 8, string.rep(rec, cost - first))
    end
    head = (head + cost) % size
    redis.call('SETRANGE', key, 0, pack('<d', head))
    newest = at
    admitted = true
    count = count + cost
    return 1, count, limit - count, 0, window
  end
  -- Refused: fits once the slot at size - limit + cost has left.
  return 0, count, math.max(limit - count, 0), slot(size - limit + cost) + window - now, newest + window - now
end)

if admitted then
  redis.call('PEXPIRE', key, window)
end
return out

#!lua
-- ratelimitd: GCRA (the generic cell rate algorithm: a token bucket kept as
-- one number), run atomically by Redis. Same arguments and reply layout as
-- sliding_window.lua, so coalesced batches work the same way. O(1) memory:
-- one string per key, the theoretical arrival time (TAT) in ms.
--
-- A limit of L per window W is a bucket of L tokens refilled at L per W:
-- one token every T = W / L ms. A request of cost c at `now` is admitted
-- iff max(TAT, now) + c T - now <= W, i.e. the bucket holds c tokens; then
-- TAT := max(TAT, now) + c T. So L requests pass at once from a full
-- bucket (the burst), and after that one every T (the rate): nginx
-- `limit_req rate=R burst=B` is L = B + 1, W = L / R.
--
-- Pacing (nginx `limit_req` without `nodelay`): an admitted request's
-- retry_after_ms is its delay, max(TAT, now) - now before this request:
-- the time until its place at the rate. A client that sleeps it sends the
-- burst upstream at the rate; one that ignores it (`nodelay`) sends it at
-- once. 0 when the bucket was full.
--
-- Replies, per request, {allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms}:
--   count      tokens in use after the request: ceil((TAT - now) / T)
--   remaining  L - count
--   retry      allowed: the pacing delay; refused: ms until c tokens are
--              back (an integer: the first whole ms at which it fits)
--   reset      ms until the bucket is full again (TAT - now, rounded up)
--
-- A refusal records nothing, and the TAT only moves forward on
-- admissions, so a refused cost c fits no sooner than its retry-after:
-- the daemon's denial cache is exact for GCRA as for the log.
--
-- KEYS[1]  the GCRA key (one Cluster slot; never another algorithm's key)
-- ARGV[1]  window length W in ms
-- ARGV[2]  now in ms from the caller's clock, or 0 to use Redis TIME
-- ARGV[3]  member id (unused; kept so every script takes the same arguments),
--          or 'r' (reserve) or 's' (settle), docs/PROTOCOL.md 4f:
--   'r': one request; when admitted, KEYS[2] (the settle record) is set to
--        "0 <cost> <charged> <born>" for SETTLE_LIFE ms (below).
--   's': ARGV[4], ARGV[5] the limit and the actual cost. KEYS[2] read and
--        deleted; none: reply {0, ...} (nothing changes). Else a shortfall
--        moves the TAT forward by (actual - estimate) T, past now + W if it
--        must: debt, every cost refused until the bucket has drained back.
--        A surplus gives back no more than charging the actual at the
--        reserve's time would have left (issue 33): the bucket as that
--        history has it is max(TAT - (estimate - actual) T, F), F the TAT
--        the admissions since the reserve make by themselves, at most
--        now + (what they charged). Tokens time has refilled since are not
--        given back a second time.
-- Reserved keys: "<TAT> <charged> <born>": charged, the ms of tokens the
-- key's admissions, reserves and debts have added since born (the first
-- reserve on it); the record keeps both as they were after its reserve.
-- A settle whose key was born again since finds it drained in between:
-- nothing to give back. When nothing was charged since its reserve, the
-- settle is exact and rewrites history: charged goes down as if the
-- actual had been reserved. A key no reserve touched stays "<TAT>".
-- ARGV[4], ARGV[5]  limit and cost of the first request (1 <= cost <= limit)
-- ARGV[6], ARGV[7]  ... of the second, and so on

local key = KEYS[1]
local window = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local n = (#ARGV - 3) / 2

--@include parts/now.lua
--@include parts/answer.lua
--@include parts/each_request.lua

-- Float error in c T must not turn an exact fit into a refusal.
local EPS = 1e-6

local stored = redis.call('GET', key)
local tat = now
-- charged and born: nil until a reserve touches the key (above).
local charged, born
if stored then
  local a, c, b = string.match(stored, '^(%S+) (%S+) (%S+)$')
  if a then
    stored, charged, born = a, tonumber(c), b
  end
  tat = math.max(tonumber(stored), now)
end
--@include parts/settle_mode.lua

-- The key as "<TAT>[ <charged> <born>]"; a full bucket keeps none.
local function save(at)
  if at <= now then
    redis.call('DEL', key)
    return
  end
  local v = string.format('%.17g', at)
  if born then
    v = v .. ' ' .. string.format('%.17g', charged) .. ' ' .. born
  end
  redis.call('SET', key, v, 'PX', math.max(1, math.ceil(at - now)))
end

if mode == 's' then
--@include gcra/gcra_settle.lua
end
local changed = false
local out = each_request(n, function(limit, cost)
  local t = window / limit
  local new_tat = tat + cost * t
  if new_tat - now <= window + EPS then
    local count = math.ceil((new_tat - now) / t - EPS)
    local delay, reset = math.ceil(tat - now - EPS), math.ceil(new_tat - now - EPS)
    tat = new_tat
    changed = true
    if mode == 'r' and not born then
      born, charged = string.format('%d', now), 0
    end
    if born then
      charged = charged + cost * t
    end
    if mode == 'r' then
      redis.call('SET', KEYS[2], string.format('0 %d %.17g %s', cost, charged, born), 'PX', SETTLE_LIFE)
    end
    return 1, count, limit - count, delay, reset
  end
  local count = math.ceil((tat - now) / t - EPS)
  return 0, count, math.max(limit - count, 0), math.ceil(new_tat - window - now - EPS), math.ceil(tat - now - EPS)
end)

if changed then
  -- %.17g keeps the double exact; the key lives until the bucket is full.
  save(tat)
end
return out

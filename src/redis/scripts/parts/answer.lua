-- Appends one request's answer to the flat reply `out`: allowed (1|0),
-- count, remaining, retry_after_ms, reset_ms.
local function answer(out, allowed, count, remaining, retry, reset)
  local at = #out
  out[at + 1], out[at + 2], out[at + 3], out[at + 4], out[at + 5] = allowed, count, remaining, retry, reset
end

-- The limit and cost of the call's j-th request (ARGV[2 + 2j], ARGV[3 + 2j]);
-- its answer is the j-th five of the reply.
local function request(j)
  return tonumber(ARGV[2 + 2 * j]), tonumber(ARGV[3 + 2 * j])
end

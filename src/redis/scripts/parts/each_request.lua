-- The flat reply of the call's n requests, each decided in order by
-- decide(limit, cost), which records what it admits and returns the
-- request's answer: allowed (1|0), count, remaining, retry_after_ms,
-- reset_ms (parts/answer.lua).
local function each_request(n, decide)
  local out = {}
  for j = 1, n do
    answer(out, decide(request(j)))
  end
  return out
end

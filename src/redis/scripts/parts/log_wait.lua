-- A log window's waits, in ms from now, for a request of `cost` on `key`
-- holding `count` admissions under `limit`: retry, 0 when it fits, else
-- until the (count + cost - limit) oldest admissions have left; reset,
-- until the newest has left (the window is empty).
local function log_wait(key, window, now, count, cost, limit)
  local retry, reset = 0, window
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if newest[2] then
    reset = tonumber(newest[2]) + window - now
  end
  if count + cost > limit then
    retry = window
    local rank = count + cost - limit - 1
    local oldest = redis.call('ZRANGE', key, rank, rank, 'WITHSCORES')
    if oldest[2] then
      retry = tonumber(oldest[2]) + window - now
    end
  end
  return retry, reset
end

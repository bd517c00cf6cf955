-- `now`, which the including script has read from its arguments: the
-- caller's clock in ms, or 0 for one clock for every gateway, the Redis
-- server's (TIME gives s and us). TIME is non-deterministic; scripts with
-- a shebang always replicate their effects, so writes after it are safe.
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

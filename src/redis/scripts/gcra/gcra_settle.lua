-- Mode 's', a reservation's settle (the header of gcra.lua).
local limit = tonumber(ARGV[4])
local actual = tonumber(ARGV[5])
local t = window / limit
local function reply(ok)
  local at = tat
  local count = math.ceil((at - now) / t - EPS)
  local left = limit - count
  if left < 0 then
    left = 0
  end
  return {ok, count, left, math.max(0, math.ceil(at + t - window - now - EPS)), math.ceil(at - now - EPS)}
end
--@include parts/settle_record.lua
local e, rc, rb = string.match(rec, '^%d+ (%d+) ?(%S*) ?(%S*)$')
local est = tonumber(e)
if actual >= est then
  tat = tat + (actual - est) * t
  if born then
    charged = charged + (actual - est) * t
  end
elseif rb ~= '' and rb == born then
  -- F is at most now + what was charged since the reserve (and at most
  -- the TAT itself).
  local since = charged - tonumber(rc)
  local back = (est - actual) * t
  tat = math.max(tat - back, math.min(tat, now + since), now)
  if since == 0 then
    charged = charged - back
  end
end
-- Else the key was born again (or the record predates this layout):
-- the reserve drained in between, nothing is given back.
save(tat)
return reply(1)

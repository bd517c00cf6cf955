-- Reserve and settle (docs/PROTOCOL.md 4f): ARGV[3] 'r' reserves (a check
-- that, when admitted, writes the settle record KEYS[2] for SETTLE_LIFE
-- ms), 's' settles (parts/settle_record.lua), anything else checks.
local mode = ARGV[3]
local SETTLE_LIFE = 86400000

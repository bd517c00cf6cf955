-- resty.ratelimitd.share: worker shares of the daemon's quota leases
-- (docs/PERFORMANCE.md "Worker shares", docs/PROTOCOL.md 4h). A policy
-- limiter with share_dict = "<lua_shared_dict>" admits a hot key from units
-- the daemon handed to this host's workers (LEASE_SHARE, op 10), with no
-- socket round trip: one atomic incr in the shared dict, no lock.
--
-- Exact: the daemon takes the units from a lease already reserved in Redis
-- and counts every one as used at the latest time any admission from that
-- lease may have (scored t0 + life), so a unit no worker uses is only
-- under-admission. A unit may be taken until the share's deadline: the
-- worker's send of op 10 (CLOCK_MONOTONIC, before the send, so only
-- earlier) plus the validity the daemon answered, which ends before the
-- daemon itself may no longer admit from the lease. The clock is read
-- after the take: an admission is never later than the read that allowed it.
--
-- One entry per (policy, key): value = deadline_ms * SPAN + units left,
-- one number, so a worker always reads a deadline with the units it was
-- granted with (a new share replaces both at once). incr(-cost) takes; a
-- result whose low part is above MAX_UNITS borrowed from the deadline
-- (units ran out): it is given back, and any worker that reads such a
-- value meanwhile sees "above MAX_UNITS" too and takes nothing, so the
-- units taken never exceed the units granted. A second entry (the entry's
-- name + "\3") holds the limit and the room outside the share (value) and
-- the window (flags) for the response's numbers; "\4", the refill guard;
-- "\5", the key's recent admissions by the daemon on this host.
-- Suffixes are control bytes, which no wire key holds: no key's entry is
-- another key's info or guard.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"
local mono_us = require("resty.ratelimitd.cache").mono_us

local floor, min = math.floor, math.min
local byte = string.byte
local transact, next_id, error_code = conn.transact, conn.next_id, wire.error_code

local _M = {}

local SPAN = 65536
-- The daemon's MAX_SHARE_UNITS (src/protocol/wire.rs).
local MAX_UNITS = 255
_M.MAX_UNITS = MAX_UNITS
-- Units asked for at once: the daemon hands at most half its lease's units left.
local WANT = 128
-- Limits above this are never shared (the info entry packs limit and room).
local MAX_LIMIT = 2 ^ 26
-- Shares are asked for a key admitted by the daemon at least HOT_HITS times
-- within HOT_S on this host (the daemon leases a key after 8 requests in a
-- lease life): a cold key costs no extra round trip. One refill per key at
-- a time on the host; after one that got nothing (the daemon holds no
-- lease yet, or the key is near its limit), none for NOTHING_S.
local HOT_HITS, HOT_S = 8, 1
local REFILL_GUARD_S, NOTHING_S = 0.05, 0.1

local function be32(s, i)
    local a, b, c, d = byte(s, i, i + 3)
    return ((a * 256 + b) * 256 + c) * 256 + d
end

--- The shared-dict entry of `lim`'s share for wire key `key`.
local function entry(lim, key)
    return "\2" .. lim._name_part .. key
end

--- Admits `cost` from the host's share of `lim` for `key`: the decision
-- table, or nil (no share, spent, or past its deadline: ask the daemon).
function _M.admit(lim, dict, key, cost)
    if cost > MAX_UNITS or not mono_us then
        return nil
    end
    local skey = entry(lim, key)
    local v = dict:incr(skey, -cost)
    if not v then
        return nil
    end
    local units = v % SPAN
    if units > MAX_UNITS then
        dict:incr(skey, cost)
        return nil
    end
    if mono_us() >= (v - units) / SPAN * 1000 then
        -- Past the deadline: the unit is burnt (counted as used: under-admission only).
        return nil
    end
    local info, window = dict:get(skey .. "\3")
    if not info then
        return nil
    end
    local outside = info % MAX_LIMIT
    local limit = (info - outside) / MAX_LIMIT
    local remaining = outside + units
    return {
        allowed = true, decision = "allowed", source = "redis",
        count = limit > remaining and limit - remaining or 0, remaining = remaining,
        retry_after_ms = 0, reset_ms = window, error_code = 0, error = "OK", message = "",
        limit = limit, policy = lim._policy, shared = true,
    }
end

--- After the daemon admitted a request of `lim` for `key` (`res`, source
-- redis): asks it for a share of its lease on the key, one worker of the
-- host at a time, and stores what it grants. Errors are ignored: the next
-- request asks the daemon as before.
function _M.refill(lim, dict, key, res)
    local limit = res.count + res.remaining
    if not mono_us or limit >= MAX_LIMIT or res.remaining < 4 then
        return
    end
    local skey = entry(lim, key)
    -- Counted without eviction (safe_add, then incr): never at the cost of
    -- the local fallback's counters in the same dict.
    local hkey = skey .. "\5"
    local hits = dict:incr(hkey, 1)
    if not hits then
        dict:safe_add(hkey, 1, HOT_S)
        return
    end
    if hits < HOT_HITS or not dict:safe_add(skey .. "\4", true, REFILL_GUARD_S) then
        return
    end
    -- Another worker's refill may have landed since this request missed:
    -- a share with units and time left is never replaced (its units would
    -- be lost: counted as used, never admitted).
    local v = dict:get(skey)
    if v then
        local units = v % SPAN
        if units > 0 and units <= MAX_UNITS and mono_us() < (v - units) / SPAN * 1000 then
            dict:delete(skey .. "\4")
            return
        end
    end
    -- The policy's frame header is built at its first request; a description
    -- that arrived meanwhile clears it (policy.lua): no refill this time.
    local header = lim._header
    if not header then
        return
    end
    local id = next_id()
    local sent_ms = floor(mono_us() / 1000)
    local head = transact(wire.lease_share(id, header, WANT, lim._name_part, key), id)
    -- No units, an error (a daemon older than op 10 answers UNKNOWN_OP) or
    -- no answer: not again for NOTHING_S, so that such a daemon costs one
    -- extra round trip per key and host every NOTHING_S, not per request.
    local units, outside, valid_ms, window = 0, 0, 0, 0
    if head and error_code(head) == 0 then
        units, outside, valid_ms, window = be32(head, 13), be32(head, 17), be32(head, 21), be32(head, 25)
    end
    if units == 0 or units > MAX_UNITS or valid_ms == 0 then
        dict:safe_set(skey .. "\4", true, NOTHING_S)
        return
    end
    local ttl = valid_ms / 1000 + 1
    dict:safe_set(skey .. "\3", limit * MAX_LIMIT + min(outside, limit), ttl, window)
    dict:safe_set(skey, (sent_ms + valid_ms) * SPAN + units, ttl)
    -- The next refill may start as soon as these units run out.
    dict:delete(skey .. "\4")
end

return _M

-- resty.ratelimitd.share: worker shares of the daemon's quota leases
-- (docs/PERFORMANCE.md "Worker shares", docs/PROTOCOL.md 4h). A policy
-- limiter, or an inline one of the log algorithm, admits a hot key from
-- units the daemon handed to this host's workers (LEASE_SHARE, op 10, or a
-- CHECK with the share flag), with no socket round trip: one atomic incr
-- in the shared dict (share_dict, or configure()'s shared_dict with
-- configure{ shares = true }; off by default), no lock.
--
-- Exact: the daemon takes the units from a lease already reserved in Redis
-- and counts every one as used at the latest time any admission from the
-- share may have (scored at the share's deadline, at most t0 + life), so a
-- unit no worker uses is only under-admission. A unit may be taken until the share's deadline: the
-- worker's send of op 10 (CLOCK_MONOTONIC, before the send, so only
-- earlier) plus the validity the daemon answered, which ends before the
-- daemon itself may no longer admit from the lease. The clock is read
-- after the take: an admission is never later than the read that allowed it.
--
-- One entry per (policy, key): value = deadline_ms * SPAN + units left,
-- one number, so a worker always reads a deadline with the units it was
-- granted with (a new share replaces both at once). incr(-cost) takes; a
-- result whose low part is above MAX_PACKED borrowed from the deadline
-- (units ran out): it is given back, and any worker that reads such a
-- value meanwhile sees "above MAX_PACKED" too and takes nothing, so the
-- units taken never exceed the units granted.
-- Topped up before it runs out: the take that brings the units left below
-- LOW asks the daemon for more while the others go on taking, and the new
-- units are added (incr) to the live entry under its deadline, the earlier
-- one (a later share's lease is the same or newer): each unit is still
-- taken before its own deadline.
--
-- Units no worker used go back to the daemon before the deadline (a
-- give-back: op 10 with flag 0x0001, or CHECK with 0x3000), which takes
-- them back into its lease: it admits from them itself, or its settle
-- removes them from Redis. Taken back from the entry in one incr that sets
-- its deadline to 0: every take after it fails, so the low part it leaves
-- is exactly the units no take had, and they are given back (a low part in
-- a borrow at that instant: none, under-admission only). By the request
-- that finds the deadline within RENEW_MS (it is admitted first, then
-- gives back and asks for a fresh share, in its own request: a steady
-- stream never leaves units at a deadline, and the daemon has them back
-- before any request that follows asks it), else by a timer of the worker
-- that installed the share, BACK_MS before the deadline (a stream that
-- stopped). Neither needs the refill guard (it also holds the refill
-- back-off): a refill that changed the entry between the read and the
-- incr shows in the incr's result, which is then undone. A replaced
-- entry's units left are given back too. Units a
-- give-back cannot return (the daemon answered nothing, or settled the
-- lease already) stay counted: under-admission only. A second entry (the entry's
-- name + "\3") holds the limit and the room outside the share (value) and
-- the window (flags) for the response's numbers; "\4", the refill guard.
-- The key's recent admissions by the daemon are counted in the worker
-- (hit() below), not in the dict: a cold key costs no shared-dict write.
-- Suffixes are control bytes, which no wire key holds: no key's entry is
-- another key's info or guard.

local wire = require "resty.ratelimitd.wire"
local conn = require "resty.ratelimitd.conn"

local ngx = ngx
local ngx_now, get_phase = ngx.now, ngx.get_phase
local floor, min = math.floor, math.min
local transact, next_id, share_grant = conn.transact, conn.next_id, wire.share_grant
local mono_us = conn.mono_us

local _M = {}

local SPAN = 65536
-- The daemon's MAX_SHARE_UNITS (src/protocol/wire.rs).
local MAX_UNITS = 255
_M.MAX_UNITS = MAX_UNITS
-- Units an entry holds at most (a top-up adds at most MAX_UNITS to fewer
-- than LOW); a low part above it is a borrow: SPAN - MAX_UNITS > MAX_PACKED.
local MAX_PACKED = 4095
-- Units asked for at once: the daemon hands at most half its lease's units
-- left. Topped up when fewer than LOW are left.
local WANT = 64
local LOW = 32
-- Limits above this are never shared (the info entry packs limit and room).
local MAX_LIMIT = 2 ^ 26
-- Shares are asked for a key this worker saw admitted by the daemon at
-- least HOT_HITS times within one to two HOT_S (the daemon leases a key
-- after 8 requests in a lease life): a cold key costs no extra round trip.
-- One refill per key at a time on the host; after one that got nothing,
-- none for the time the daemon said (its lease call for the key is in
-- flight: about a round trip) or, when it said none, for NOTHING_S (the
-- key is not leased, or near its limit).
local HOT_HITS, HOT_S = 8, 1
local REFILL_GUARD_S, NOTHING_S = 0.05, 0.1
-- A take that finds the deadline this close renews the share (gives the
-- units left back, asks for fresh ones); the timer gives them back BACK_MS
-- before it. Shares are valid 20 ms at least (the daemon's
-- MIN_RATE_VALID_MS), but a hundredth of the window if that is less (10 ms
-- for 1 s): RENEW_MS is then a quarter of that (admit).
local RENEW_MS, BACK_MS = 8, 2
-- Keys counted per generation at most: a flood of distinct keys starts a
-- new generation early, so the counts take at most 2 x HOT_KEYS entries.
local HOT_KEYS = 4096

-- This worker's daemon admissions per share entry: the current generation
-- (begun at hits_since, hits_n keys) and the one before, whose count a key
-- carries on with. Plain Lua tables: no lock, no shared-dict node per
-- cold key.
local hits_now, hits_before, hits_n, hits_since = {}, {}, 0, 0

local function hit(skey)
    local now = ngx_now()
    if now - hits_since >= HOT_S or hits_n >= HOT_KEYS then
        -- The generation before is carried on only if it ended just now.
        hits_before = now - hits_since < 2 * HOT_S and hits_now or {}
        hits_now, hits_n, hits_since = {}, 0, now
    end
    local n = hits_now[skey]
    if not n then
        n = hits_before[skey] or 0
        hits_n = hits_n + 1
    end
    n = n + 1
    hits_now[skey] = n
    return n
end

-- Phases whose requests may open a cosocket: a take elsewhere (a check()
-- in a header filter, say) admits, but does not top up.
local MAY_CONNECT = { rewrite = true, access = true, content = true, timer = true, ssl_cert = true, ssl_session_fetch = true }

--- The shared-dict entries of `lim`'s share for wire key `key`: the units
-- and the info entry, under the limiter kind's prefix (a policy's name, or
-- an inline limit and window). The limiter keeps the names of its last key,
-- so a hot key's request makes no string (two concatenations and their
-- interning, per request, before).
local function entries(lim, key)
    if lim._share_key == key then
        return lim._share_entry, lim._share_info
    end
    local skey = lim._share_prefix .. key
    local info = skey .. "\3"
    lim._share_key, lim._share_entry, lim._share_info = key, skey, info
    return skey, info
end

-- Takes the units left out of entry `skey` if its deadline is still
-- `deadline` (ms): how many, for a give-back; its deadline is then 0, so
-- no take after this one admits.
local function reclaim(dict, skey, deadline)
    local v = dict:get(skey)
    if not v then
        return 0
    end
    local left = v % SPAN
    if left == 0 or left > MAX_PACKED or (v - left) / SPAN ~= deadline then
        return 0
    end
    local now = dict:incr(skey, -deadline * SPAN)
    if not now then
        return 0
    end
    if now < 0 or now > MAX_PACKED then
        -- A take's borrow at that instant (its units would be given back
        -- twice), or a refill replaced the entry since the read: undone,
        -- the entry is as it was (under-admission at most).
        dict:incr(skey, deadline * SPAN)
        return 0
    end
    return now
end

-- Gives `units` of `lim`'s share of `key` back to the daemon, unused:
-- the units it took back (0: none) and the key's room outside the shares
-- it then tells. Errors are ignored: the units stay counted,
-- under-admission only.
local function give_back(lim, key, units)
    if units <= 0 then
        return 0, 0
    end
    local id = next_id()
    local frame = lim:_share_frame(id, units, key, true)
    if frame then
        local h = transact(frame, id)
        if h then
            -- count: the units taken back; remaining: the room outside.
            local taken, room = share_grant(h)
            return taken, room
        end
    end
    return 0, 0
end

-- The timer BACK_MS before a share's deadline: the units no take had go
-- back to the daemon (none if a request renewed the share first).
local function expire(_, lim, dict, skey, key, deadline)
    give_back(lim, key, reclaim(dict, skey, deadline))
end

-- Runs `expire` BACK_MS before `deadline` (at once if that is past).
local function schedule(lim, dict, skey, key, deadline)
    local wait = (deadline - BACK_MS) / 1000 - mono_us() / 1e6
    ngx.timer.at(wait > 0 and wait or 0, expire, lim, dict, skey, key, deadline)
end

-- Asks the daemon for units of `lim`'s lease on `key` (entry `skey`, the
-- key's limit `limit`) and stores them; the caller holds the refill guard.
-- Stored by one incr of the difference, never a set: a take or a give-back
-- of another worker between the read and the write keeps its effect, so
-- no unit is granted twice. Added to a live entry (one with units and
-- time left), under the earlier of the two deadlines (a later share may
-- end first: its lease has less life left); else the entry is replaced
-- and its units left are given back. Not while the entry is borrowed (a
-- take is about to give back): the units are burnt instead
-- (under-admission only). Errors are ignored: the next request asks the
-- daemon.
local function ask(lim, dict, skey, key, limit)
    -- The kind's frame (nil: not now, e.g. a policy limiter whose header
    -- a description just cleared: no refill this time).
    local id = next_id()
    local frame = lim:_share_frame(id, WANT, key)
    if not frame then
        return
    end
    local sent_ms = floor(mono_us() / 1000)
    local head = transact(frame, id)
    -- No units, an error (a daemon older than op 10 answers UNKNOWN_OP) or
    -- no answer: not again for NOTHING_S, so that such a daemon costs one
    -- extra round trip per key and host every NOTHING_S, not per request;
    -- or as soon as the daemon said (no units, retry_after_ms > 0: its
    -- lease call is in flight), never later than NOTHING_S.
    local units, outside, valid_ms, window = 0, 0, 0, 0
    if head then
        units, outside, valid_ms, window = share_grant(head)
    end
    if units == 0 or units > MAX_UNITS or valid_ms == 0 then
        local again = NOTHING_S
        if units == 0 and valid_ms > 0 then
            again = min(valid_ms / 1000, NOTHING_S)
        end
        dict:safe_set(skey .. "\4", true, again)
        return
    end
    local deadline = sent_ms + valid_ms
    local ttl = valid_ms / 1000 + 1
    dict:safe_set(skey .. "\3", limit * MAX_LIMIT + min(outside, limit), ttl, window)
    local v = dict:get(skey)
    if not v then
        dict:safe_add(skey, deadline * SPAN + units, ttl)
        schedule(lim, dict, skey, key, deadline)
    else
        local left = v % SPAN
        local live = (v - left) / SPAN
        if left > MAX_PACKED then
            -- Borrowed: burnt (see above).
            return
        end
        local replaced = not (left > 0 and mono_us() < live * 1000 and left + units <= MAX_PACKED)
        -- A replaced entry's units left are taken out in the step that
        -- ends it, as the give-back timer takes them (reclaim): whichever
        -- runs first has them, the other none, so none is given back twice
        -- (a take since the read was charged to them, or fails).
        local back = 0
        if replaced and live > 0 and left > 0 then
            back = reclaim(dict, skey, live)
            v = dict:get(skey) or v
        end
        -- Past whichever deadline it keeps.
        dict:expire(skey, ttl)
        local target = deadline * SPAN + units
        if not replaced then
            target = min(live, deadline) * SPAN + left + units
        end
        if not dict:incr(skey, target - v) then
            -- Expired between the read and the write.
            dict:safe_add(skey, target, ttl)
        end
        if replaced then
            schedule(lim, dict, skey, key, deadline)
        elseif deadline < live then
            -- An earlier deadline: its own give-back timer (the one before
            -- finds the deadline changed and gives nothing).
            schedule(lim, dict, skey, key, deadline)
        end
        -- The room the daemon then tells is the room outside the new units.
        if back > 0 then
            local taken, room = give_back(lim, key, back)
            if taken > 0 then
                dict:safe_set(skey .. "\3", limit * MAX_LIMIT + min(room, limit), ttl, window)
            end
        end
    end
    -- The next refill may start as soon as these units run low.
    dict:delete(skey .. "\4")
end

--- The shared dict `lim` keeps its shares in, or nil: its own share_dict
-- (false: none), else configure()'s shared_dict while `shares` is on.
-- Read per request, as configure() may run after the limiter was made.
function _M.dict(lim, settings)
    local dict = lim._share_dict
    if dict == nil and settings.shares then
        return ngx.shared[settings.shared_dict]
    end
    return dict or nil
end

--- Admits `cost` from the host's share of `lim` for `key`: the decision
-- table, or nil (no share, spent, or past its deadline: ask the daemon).
-- The take that leaves fewer than LOW units tops the share up first.
function _M.admit(lim, dict, key, cost)
    if cost > MAX_UNITS or not mono_us then
        return nil
    end
    local skey, ikey = entries(lim, key)
    local v = dict:incr(skey, -cost)
    if not v then
        return nil
    end
    local units = v % SPAN
    if units > MAX_PACKED then
        dict:incr(skey, cost)
        return nil
    end
    local deadline = (v - units) / SPAN
    local now_us = mono_us()
    if now_us >= deadline * 1000 then
        -- Past the deadline (or given back: deadline 0): not admitted. The
        -- units taken are not put back into the entry (a refill may have
        -- replaced it since: they would be admitted from the new one,
        -- after their own deadline) but given back to the daemon, with
        -- the units left if the entry is still this share: its give-back
        -- timer runs before the deadline unless the worker is late, as on
        -- a loaded host. Those of a share already given back were given
        -- back with it; where no cosocket may open, they are lost
        -- (under-admission only).
        if deadline > 0 and MAY_CONNECT[get_phase()] then
            give_back(lim, key, cost + reclaim(dict, skey, deadline))
        end
        return nil
    end
    local info, window = dict:get(ikey)
    if not info then
        return nil
    end
    local outside = info % MAX_LIMIT
    local limit = (info - outside) / MAX_LIMIT
    -- A quarter of the longest share of the window (a hundredth of it)
    -- if that is less: a 10 ms share of a 1 s window is renewed 2.5 ms
    -- before its deadline.
    local renew = now_us >= (deadline - min(RENEW_MS, (window or 0) / 400)) * 1000
    if renew or units < LOW and units + cost >= LOW then
        local may_connect = MAY_CONNECT[get_phase()]
        if renew and may_connect then
            -- This admission stands (before the deadline); the units left
            -- go back, then fresh ones are asked for.
            give_back(lim, key, reclaim(dict, skey, deadline))
        end
        if may_connect and dict:safe_add(skey .. "\4", true, REFILL_GUARD_S) then
            ask(lim, dict, skey, key, limit)
        end
    end
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
-- host at a time, if this worker saw the key hot, and stores what it grants.
function _M.refill(lim, dict, key, res)
    local limit = res.count + res.remaining
    if not mono_us or limit >= MAX_LIMIT or res.remaining < 4 then
        return
    end
    local skey = entries(lim, key)
    if hit(skey) < HOT_HITS or not dict:safe_add(skey .. "\4", true, REFILL_GUARD_S) then
        return
    end
    -- Another worker's refill may have landed since this request missed:
    -- no round trip for a share with units and time left.
    local v = dict:get(skey)
    if v then
        local units = v % SPAN
        if units >= LOW and units <= MAX_PACKED and mono_us() < (v - units) / SPAN * 1000 then
            dict:delete(skey .. "\4")
            return
        end
    end
    ask(lim, dict, skey, key, limit)
end

return _M

-- resty.ratelimitd.verify: the worker-start verifier. Every limiter that
-- names policies registers here when it is made; schedule() (called by
-- limiters.build, or by verify_policies() from init_worker_by_lua)
-- describes them (describe.lua) in a timer right after the worker starts,
-- and again with a back-off while the daemon cannot be reached, so that a
-- name the daemon lacks (a typo, a rename) is said loudly in error.log when
-- the worker starts, not found by the first 503. Nothing here runs on the
-- request path.

local describe = require "resty.ratelimitd.describe"
local config = require "resty.ratelimitd.config"

local bit = require "bit"

local ngx = ngx
local ngx_log, ERR = ngx.log, ngx.ERR
local min = math.min
local bor = bit.bor
local pairs, ipairs, setmetatable, tostring, type = pairs, ipairs, setmetatable, tostring, type

local _M = {}

-- Every limiter naming policies in this worker, with the name it was built
-- under (weak keys: a limiter dropped is not verified).
local registered = setmetatable({}, { __mode = "k" })

local RETRY_MIN, RETRY_MAX = 1, 30 -- s between two attempts while the daemon is unreachable

--- Registers `lim` (fields _policy, or _names for several) for verification.
function _M.register(lim)
    registered[lim] = true
end

-- One line per host, not one per worker (config.lua).
local loud = config.loud

local running = false

-- Describes every registered limiter not yet described; true when none is
-- left (or nil and the error that stopped it: the daemon is unreachable).
local function verify_all()
    -- Every use of each name by the limiters left, in one description.
    local uses = {}
    for lim in pairs(registered) do
        if not lim._described then
            local u = describe.uses(lim)
            for _, name in ipairs(lim._names or { lim._policy }) do
                uses[name] = bor(uses[name] or 0, u)
            end
        end
    end
    local seen = {}
    for lim in pairs(registered) do
        if not lim._described then
            local names = lim._names or { lim._policy }
            local all_known = true
            local ds = {}
            for _, name in ipairs(names) do
                local d = seen[name]
                if d == nil then
                    local err
                    d, err = describe.describe(name, uses[name])
                    if d == nil then
                        return nil, err
                    end
                    seen[name] = d
                    if d == false and loud() then
                        -- One line per unknown name.
                        ngx_log(ERR, "ratelimitd: policy \"", name, "\" is not in the daemon's configuration (",
                            tostring(err), "): every request of its limiter gets the location's on_error until the daemon has it",
                            " (ratelimitd check-config --nginx says which names nginx uses)")
                    end
                end
                if d == false then
                    all_known = false
                elseif not lim._names then
                    describe.apply(lim, d)
                else
                    ds[#ds + 1] = d
                end
            end
            if lim._names and all_known then
                describe.apply_many(lim, ds)
            end
            lim._described = true
            if not all_known then
                lim._unknown = true
            end
        end
    end
    return true
end

local function timer(premature, delay)
    if premature then
        running = false
        return
    end
    local ok, err = verify_all()
    if ok then
        running = false
        return
    end
    if loud() and delay == RETRY_MIN then
        ngx_log(ERR, "ratelimitd: cannot verify the policy names of this worker's limiters yet (", tostring(err),
            "): retrying every ", RETRY_MIN, " to ", RETRY_MAX, " s")
    end
    local next_delay = min(delay * 2, RETRY_MAX)
    local ok2, terr = ngx.timer.at(delay, timer, next_delay)
    if not ok2 then
        running = false
        ngx_log(ERR, "ratelimitd: cannot schedule the policy verification: ", tostring(terr))
    end
end

--- Describes the registered limiters in a timer (from init_worker_by_lua,
-- or later): true, or nil and why not (in init_by_lua there are no timers:
-- the workers' init_worker must call it).
function _M.schedule()
    if running then
        return true
    end
    if type(ngx.get_phase) == "function" and ngx.get_phase() == "init" then
        return nil, "no timers in init_by_lua: call require(\"resty.ratelimitd\").verify_policies() from init_worker_by_lua"
    end
    local ok, err = ngx.timer.at(0, timer, RETRY_MIN)
    if not ok then
        return nil, err
    end
    running = true
    return true
end

return _M

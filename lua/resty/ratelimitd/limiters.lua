-- resty.ratelimitd.limiters: a worker's limiters, each built on its own, so
-- that one that cannot be built takes down only its own location.
--
--   limiters = require("resty.ratelimitd.limiters").build{
--       order  = { limit = 1000, window_ms = 1000, on_error = "closed" },
--       login  = "login",                       -- a [[policy]] by name
--   }
--   limiters.order:limit("order:" .. tenant)   -- in the location, as with new()
--
-- With assert(ratelimitd.new{...}) for each, one bad option raised in
-- init_worker_by_lua and left every location without its limiters (500 on
-- all of them). Here a limiter whose options are refused is logged at CRIT
-- when the worker starts (`ratelimitd: limiter "pay" not built: <reason>`)
-- and replaced by a stand-in used only by its own location: its limit()
-- answers 500, or lets the request through when its options say
-- on_error = "open" (the location's own choice for "no decision"); each
-- request it sees logs `limiter_not_built` (rate-limited like the client's
-- other failure lines); its check() returns nil and the reason.
-- Then the policy names the limiters use are checked against the daemon
-- (DESCRIBE_POLICY, in a timer right after the worker starts): an unknown
-- name is one error line (`ratelimitd: policy "login" is not in the
-- daemon's configuration ...`), and a policy limiter takes the window and
-- local quota of its own fallback from its policy.

local ratelimitd = require "resty.ratelimitd"
local config = require "resty.ratelimitd.config"
local verify = require "resty.ratelimitd.verify"

local ngx = ngx
local ngx_log, CRIT, ngx_exit = ngx.log, ngx.CRIT, ngx.exit
local type, pairs, pcall, tostring, setmetatable = type, pairs, pcall, tostring, setmetatable

local _M = {}

local Broken = {}
Broken.__index = Broken

-- The location of a limiter that was not built.
function Broken:limit()
    config.failure("limiter_not_built", self.name, self.reason)
    if self.open then
        return true
    end
    return ngx_exit(500)
end

function Broken:check()
    return nil, "limiter " .. self.name .. " not built: " .. self.reason
end

local function broken(name, spec, reason)
    ngx_log(CRIT, "ratelimitd: limiter \"", name, "\" not built: ", reason,
        "; its location answers ", (type(spec) == "table" and spec.on_error == "open") and "as if allowed (on_error = \"open\")" or "500",
        ", the other limiters are not affected")
    return setmetatable({ name = name, reason = reason, open = type(spec) == "table" and spec.on_error == "open" }, Broken)
end

--- Builds every limiter of `specs` (name -> options table, or a policy
-- name); never raises for a bad spec. Returns the table of limiters, each
-- the object from new() or a stand-in, and the number not built.
function _M.build(specs)
    local out, failed = {}, 0
    for name, spec in pairs(specs) do
        local ok, lim, err = pcall(ratelimitd.new, spec)
        if ok and lim then
            out[name] = lim
        else
            failed = failed + 1
            out[name] = broken(tostring(name), spec, ok and tostring(err) or tostring(lim))
        end
    end
    -- The policy names they use, checked against the daemon right after
    -- the worker starts (verify.lua): one error line per unknown name.
    -- In init_by_lua (no timers) the workers' init_worker must ask for it.
    local scheduled, why = verify.schedule()
    if not scheduled and ngx.get_phase() ~= "init" then
        ngx_log(CRIT, "ratelimitd: the policy names of the limiters cannot be verified: ", why)
    end
    return out, failed
end

return _M

-- resty.ratelimitd.options: the one table of option specs every
-- constructor validates against (new, concurrency and the table form):
-- which options a limiter kind takes, what each must be, and the rules
-- between them. Returns messages, never raises: new() hands them back as
-- nil, err, the table form raises them.

local wire = require "resty.ratelimitd.wire"
local HEADER_STYLES = require("resty.ratelimitd.config").HEADER_STYLES

local floor = math.floor
local find = string.find
local type, tostring, pairs, ipairs = type, tostring, pairs, ipairs
local POLICY, ALGORITHM = wire.POLICY, wire.ALGORITHM
local MAX_POLICY_NAME_LEN, MAX_POLICY_ITEMS = wire.MAX_POLICY_NAME_LEN, wire.MAX_POLICY_ITEMS

local _M = {}

-- The fail policy of a limiter whose location chose none: open, with one
-- line at error level when the limiter is made (config.default_on_error), as
-- Envoy's failure_mode_deny = false. The same default in ratelimitd.toml
-- (a policy without on_error takes the request's) and `ratelimitd query`.
local DEFAULT_ON_ERROR = "open"
_M.DEFAULT_ON_ERROR = DEFAULT_ON_ERROR

local function positive_int(v)
    return type(v) == "number" and v >= 1 and v <= 4294967295 and floor(v) == v
end

local function status(v)
    return type(v) == "number" and v >= 200 and v <= 599 and floor(v) == v
end

local function boolean(v)
    return type(v) == "boolean"
end

-- A policy's name as ratelimitd.toml allows it: 1 to 31 of A-Z a-z 0-9 _ . -
local function policy_name(name)
    return type(name) == "string" and #name >= 1 and #name <= MAX_POLICY_NAME_LEN and not find(name, "[^%w_.-]")
end
_M.valid_policy_name = policy_name

local POLICY_NAME_MSG = "policy must be a name of 1 to " .. MAX_POLICY_NAME_LEN .. " characters A-Z a-z 0-9 _ . -"

local function name_list(v)
    if type(v) ~= "table" or #v < 1 or #v > MAX_POLICY_ITEMS then
        return false
    end
    for _, name in ipairs(v) do
        if not policy_name(name) then
            return false
        end
    end
    return true
end

local algorithm_names = {}
for name, v in pairs(ALGORITHM) do
    algorithm_names[v + 1] = "'" .. name .. "'"
end

-- Every option: the check of its value and the message when it fails.
-- Checked in this order, so the first message is the same whatever order
-- pairs() walks the options in.
local SPECS = {
    { "limit", positive_int, "limit must be a positive integer" },
    { "window_ms", positive_int, "window_ms must be a positive integer" },
    { "lease_ms", positive_int, "lease_ms must be a positive integer" },
    { "cost", positive_int, "cost must be a positive integer" },
    { "policy", policy_name, POLICY_NAME_MSG },
    { "policies", name_list, "policies must be a list of 1 to " .. MAX_POLICY_ITEMS .. " policy names" },
    { "on_error", function(v) return POLICY[v] ~= nil end, "on_error must be 'open', 'closed' or 'local'" },
    { "local_limit", positive_int, "local_limit must be a positive integer" },
    { "header_style", function(v) return HEADER_STYLES[v] ~= nil end, "header_style must be 'ratelimit', 'draft' or 'x'" },
    { "status", status, "status must be an HTTP status (200-599)" },
    { "fail_closed_status", status, "fail_closed_status must be an HTTP status (200-599)" },
    { "invalid_status", status, "invalid_status must be an HTTP status (200-599)" },
    { "headers", boolean, "headers must be a boolean" },
    { "dry_run", boolean, "dry_run must be a boolean" },
    { "denial_cache", boolean, "denial_cache must be a boolean" },
    { "refundable", boolean, "refundable must be a boolean" },
    { "settle", boolean, "settle must be a boolean" },
    { "algorithm", function(v) return ALGORITHM[v] ~= nil end, "algorithm must be one of " .. table.concat(algorithm_names, ", ") },
    -- Pacing, as nginx limit_req: without nodelay an admitted request
    -- waits its delay; `delay` requests of a burst pass at once first.
    { "nodelay", boolean, "nodelay must be a boolean" },
    { "delay", function(v) return type(v) == "number" and v >= 0 and floor(v) == v end,
      "delay must be a non-negative integer (requests of a burst passed at once)" },
    -- Policies in shadow mode in ratelimitd.toml: never shown in headers
    -- (the daemon marks them shadow_allowed/shadow_denied; the list is for
    -- an older daemon that marks only refusals).
    -- Worker shares of the daemon's quota leases (share.lua): the
    -- lua_shared_dict they are kept in, or false for none; unset:
    -- configure()'s shared_dict while configure{ shares = true }.
    { "share_dict", function(v) return v == false or type(v) == "string" and ngx ~= nil and ngx.shared[v] ~= nil end,
      "share_dict must be the name of a lua_shared_dict, or false" },
    { "shadow", name_list, "shadow must be a list of policy names (those in shadow mode in ratelimitd.toml)" },
}

-- What every limiter takes: the fail policy and what limit() does with a
-- decision.
local BEHAVIOUR = { "on_error", "local_limit", "status", "fail_closed_status", "invalid_status", "headers", "header_style", "dry_run" }

local function kind(extra, refused, unknown_suffix)
    local allowed = {}
    for _, k in ipairs(BEHAVIOUR) do
        allowed[k] = true
    end
    for _, k in ipairs(extra) do
        allowed[k] = true
    end
    return { allowed = allowed, refused = refused or {}, unknown_suffix = unknown_suffix or "" }
end

local PER_REQUEST = "is given per request: lim:limit(key, cost)"
local POLICY_HOLDS = "is not an option of a policy limiter: the limit and algorithm are the policy's, in ratelimitd.toml; key and cost are given per request"

-- The limiter kinds and their options; `refused`: options of other kinds
-- with the message that says why not here.
local KINDS = {
    inline = kind({ "limit", "window_ms", "denial_cache", "algorithm", "nodelay", "delay", "share_dict" }, { key = PER_REQUEST, cost = PER_REQUEST }),
    table_form = kind({ "key", "cost", "limit", "window_ms", "denial_cache", "algorithm", "nodelay", "delay" }),
    policy = kind({ "policy", "window_ms", "nodelay", "delay", "shadow", "share_dict" },
                  { limit = POLICY_HOLDS, cost = POLICY_HOLDS, key = POLICY_HOLDS, algorithm = POLICY_HOLDS }),
    -- Worker shares (share.lua) admit single checks of one policy: a
    -- multi-item, refundable or settle check always asks the daemon.
    multi = kind({ "policy", "policies", "refundable", "settle", "window_ms", "shadow" },
                 { share_dict = "is for a one-policy limiter only (no policies list, refundable or settle): worker shares admit single checks" },
                 " for a policy limiter"),
    concurrency = kind({ "limit", "lease_ms" }),
    concurrency_policy = kind({ "policy", "lease_ms" },
        { limit = "is not an option of a policy limiter: the limit and lease are the policy's, in ratelimitd.toml" }),
}

-- The rules between options, per kind: the first broken one's message.
local function rules(k, opts)
    local on_error = opts.on_error or DEFAULT_ON_ERROR
    -- A policy limiter (one policy or several) takes its local quota
    -- (and window) from each policy when nginx does not give them
    -- (verify.lua).
    if on_error == "local" and opts.local_limit == nil and k ~= "policy" and k ~= "multi" then
        return "on_error = 'local' needs a positive integer local_limit"
    end
    if k == "inline" or k == "table_form" then
        if opts.limit == nil then
            return "limit must be a positive integer"
        end
        if opts.window_ms == nil then
            return "window_ms must be a positive integer"
        end
        if (opts.nodelay ~= nil or opts.delay ~= nil) and opts.algorithm ~= "gcra" then
            return "nodelay and delay apply to algorithm = 'gcra' only"
        end
        if opts.share_dict and (opts.algorithm or "log") ~= "log" then
            return "share_dict applies to algorithm = 'log' only (the daemon shares the log's leases)"
        end
    elseif k == "policy" or k == "multi" then
        if k == "multi" and opts.policy ~= nil and opts.policies ~= nil then
            return "give policy or policies, not both"
        end
        if opts.settle and opts.refundable then
            return "settle = true reserves and settles: without refundable (PROTOCOL.md 4f)"
        end
        if opts.policies then
            local seen = {}
            for _, name in ipairs(opts.policies) do
                if seen[name] then
                    return "policy '" .. name .. "' is listed twice"
                end
                seen[name] = true
            end
        end
    elseif k == "concurrency" then
        if opts.limit == nil then
            return "limit must be a positive integer"
        end
        if opts.lease_ms == nil then
            return "lease_ms must be a positive integer (how long a lease never released holds its slot)"
        end
    elseif k == "concurrency_policy" then
        if on_error == "local" and opts.lease_ms == nil then
            return "on_error = 'local' needs lease_ms: the window of this client's own fallback quota"
        end
    end
end

--- Checks `opts` for a limiter of kind `k`: the fail policy's name
-- (on_error, "open" by default: docs/CONFIG.md says why), or nil and the
-- first problem.
function _M.check(k, opts)
    local spec = KINDS[k]
    for name in pairs(opts) do
        if not spec.allowed[name] then
            local why = spec.refused[name]
            if why then
                return nil, name .. " " .. why
            end
            return nil, "unknown option '" .. tostring(name) .. "'" .. spec.unknown_suffix
        end
    end
    for _, s in ipairs(SPECS) do
        local v = opts[s[1]]
        if v ~= nil and not s[2](v) then
            return nil, s[3]
        end
    end
    local err = rules(k, opts)
    if err then
        return nil, err
    end
    return opts.on_error or DEFAULT_ON_ERROR
end

--- The behaviour options of `opts` copied onto the limiter `lim`, under
-- their own names (limit() reads them there, or from the table form's own
-- options table).
function _M.copy_behaviour(lim, opts)
    for _, k in ipairs(BEHAVIOUR) do
        if k ~= "on_error" and k ~= "local_limit" then
            lim[k] = opts[k]
        end
    end
    lim.nodelay = opts.nodelay
    lim.delay = opts.delay
    return lim
end

--- A set of the names in `list` (nil for none).
function _M.name_set(list)
    if not list then
        return nil
    end
    local set = {}
    for _, name in ipairs(list) do
        set[name] = true
    end
    return set
end

return _M

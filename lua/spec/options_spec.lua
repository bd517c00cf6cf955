-- The one table of option specs: every constructor's messages, the kinds'
-- own options and the rules between options.

-- config.lua's log lines read ngx when loaded; nothing here calls them.
_G.ngx = _G.ngx or { log = function() end, now = function() return 0 end, ERR = 4, WARN = 5 }
local options = require "resty.ratelimitd.options"

local function check(kind, opts)
    local on_error, err = options.check(kind, opts)
    return on_error or err
end

describe("options", function()
    it("accepts good options and defaults on_error to open (docs/CONFIG.md, on_error)", function()
        assert.equals("open", check("inline", { limit = 10, window_ms = 1000 }))
        assert.equals("local", check("inline", { limit = 10, window_ms = 1000, on_error = "local", local_limit = 3, dry_run = false }))
        assert.equals("open", check("policy", { policy = "order", on_error = "open", nodelay = true, shadow = { "order" } }))
        assert.equals("open", check("multi", { policies = { "a", "b" }, refundable = true, header_style = "draft" }))
        assert.equals("open", check("multi", { policy = "tokens", settle = true }))
        assert.equals("open", check("multi", { policies = { "tokens_minute", "tokens_month" }, settle = true }))
        local err = check("multi", { policy = "a", settle = true, refundable = true })
        assert.matches("without refundable", err, 1, true)
        assert.equals("open", check("concurrency", { limit = 2, lease_ms = 1000 }))
        assert.equals("open", check("concurrency_policy", { policy = "uploads" }))
        assert.equals("open", check("table_form", { key = "k", cost = 2, limit = 10, window_ms = 1000 }))
        -- Worker shares: on by default (configure()'s shared_dict), false turns them off.
        assert.equals("open", check("inline", { limit = 10, window_ms = 1000, share_dict = false }))
        assert.equals("open", check("policy", { policy = "order", share_dict = false }))
        assert.equals("open", check("inline", { limit = 10, window_ms = 1000, algorithm = "gcra", share_dict = false }))
        local saved = _G.ngx
        _G.ngx = { shared = { x = {} } }
        local refused = check("inline", { limit = 10, window_ms = 1000, algorithm = "gcra", share_dict = "x" })
        _G.ngx = saved
        assert.matches("share_dict applies to algorithm = 'log' only", refused, 1, true)
    end)

    it("says what is wrong with a value, the same for every kind", function()
        for _, case in ipairs({
            { { limit = 0, window_ms = 1000 }, "limit must be a positive integer" },
            { { limit = 1.5, window_ms = 1000 }, "limit must be a positive integer" },
            { { limit = "10", window_ms = 1000 }, "limit must be a positive integer" },
            { { limit = 2 ^ 32, window_ms = 1000 }, "limit must be a positive integer" },
            { { limit = 10 }, "window_ms must be a positive integer" },
            { { limit = 10, window_ms = 0 }, "window_ms must be a positive integer" },
            { { limit = 10, window_ms = 1000, on_error = "maybe" }, "on_error must be 'open', 'closed' or 'local'" },
            { { limit = 10, window_ms = 1000, on_error = "local" }, "on_error = 'local' needs a positive integer local_limit" },
            { { limit = 10, window_ms = 1000, local_limit = 0 }, "local_limit must be a positive integer" },
            { { limit = 10, window_ms = 1000, header_style = "y" }, "header_style must be 'ratelimit', 'draft' or 'x'" },
            { { limit = 10, window_ms = 1000, status = 99 }, "status must be an HTTP status (200-599)" },
            { { limit = 10, window_ms = 1000, fail_closed_status = 600 }, "fail_closed_status must be an HTTP status (200-599)" },
            { { limit = 10, window_ms = 1000, headers = "yes" }, "headers must be a boolean" },
            { { limit = 10, window_ms = 1000, dry_run = 1 }, "dry_run must be a boolean" },
            { { limit = 10, window_ms = 1000, windows_ms = 1000 }, "unknown option 'windows_ms'" },
            { { limit = 10, window_ms = 1000, key = "k" }, "key is given per request: lim:limit(key, cost)" },
            { { limit = 10, window_ms = 1000, algorithm = "leaky" }, "algorithm must be one of 'log', 'ring', 'gcra', 'sliding_counter', 'fixed'" },
            { { limit = 10, window_ms = 1000, nodelay = true }, "nodelay and delay apply to algorithm = 'gcra' only" },
            { { limit = 10, window_ms = 1000, algorithm = "gcra", delay = -1 }, "delay must be a non-negative integer (requests of a burst passed at once)" },
        }) do
            assert.equals(case[2], check("inline", case[1]))
        end
    end)

    it("tells a policy limiter's options from an inline limiter's", function()
        assert.equals("limit is not an option of a policy limiter: the limit and algorithm are the policy's, in ratelimitd.toml; key and cost are given per request",
                      check("policy", { policy = "order", limit = 5 }))
        assert.equals("policy must be a name of 1 to 31 characters A-Z a-z 0-9 _ . -", check("policy", { policy = "bad name" }))
        -- A policy limiter's fallback takes the policy's window and local
        -- quota from the daemon (DESCRIBE_POLICY); a multi-item one each
        -- policy's.
        assert.equals("local", check("policy", { policy = "order", on_error = "local", local_limit = 5 }))
        assert.equals("local", check("policy", { policy = "order", on_error = "local" }))
        assert.equals("local", check("multi", { policies = { "a", "b" }, on_error = "local", local_limit = 5 }))
        assert.equals("local", check("multi", { policies = { "a", "b" }, on_error = "local" }))
        assert.equals("on_error = 'local' needs a positive integer local_limit", check("inline", { limit = 1, window_ms = 1000, on_error = "local" }))
        assert.equals("shadow must be a list of policy names (those in shadow mode in ratelimitd.toml)", check("policy", { policy = "order", shadow = "order" }))
        assert.equals("unknown option 'algorithm' for a policy limiter", check("multi", { policies = { "a" }, algorithm = "gcra" }))
        assert.equals("policy 'a' is listed twice", check("multi", { policies = { "a", "b", "a" } }))
        assert.equals("policies must be a list of 1 to 8 policy names", check("multi", { policies = { "1", "2", "3", "4", "5", "6", "7", "8", "9" } }))
        assert.equals("give policy or policies, not both", check("multi", { policy = "a", policies = { "b" } }))
    end)

    it("checks concurrency limiters' lease", function()
        assert.equals("lease_ms must be a positive integer (how long a lease never released holds its slot)", check("concurrency", { limit = 2 }))
        assert.equals("limit is not an option of a policy limiter: the limit and lease are the policy's, in ratelimitd.toml",
                      check("concurrency_policy", { policy = "uploads", limit = 3 }))
        assert.equals("on_error = 'local' needs lease_ms: the window of this client's own fallback quota",
                      check("concurrency_policy", { policy = "uploads", on_error = "local", local_limit = 2 }))
    end)

    it("copies the behaviour options, nothing else", function()
        local lim = options.copy_behaviour({}, { limit = 1, window_ms = 1, status = 403, headers = false, nodelay = true, on_error = "open" })
        assert.same({ status = 403, headers = false, nodelay = true }, lim)
        assert.same({ a = true, b = true }, options.name_set({ "a", "b" }))
        assert.is_nil(options.name_set(nil))
    end)
end)

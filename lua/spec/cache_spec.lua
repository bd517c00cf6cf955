-- The denial cache's arithmetic: how long a refusal is kept, and what a
-- later request meets (times in µs of the monotonic clock), with a plain
-- table standing in for the shared dict.

local cache = require "resty.ratelimitd.cache"

-- The subset of ngx.shared.DICT the cache uses.
local function dict()
    local values, flags = {}, {}
    return {
        get = function(_, k) return values[k], flags[k] end,
        safe_set = function(_, k, v, _, f)
            values[k], flags[k] = v, f
            return true
        end,
        values = values,
    }
end

local refused = { decision = "denied", source = "redis", count = 5, remaining = 0, retry_after_ms = 800, reset_ms = 900 }

describe("denial cache", function()
    it("ends an entry 1 ms and 0.05 % early, at most max_ms, never below 1 ms", function()
        assert.equals(800 - 1 - 0.4, cache.life_ms(800, 1000))
        assert.equals(1000, cache.life_ms(5000, 1000))
        assert.equals(1000, cache.life_ms(1002, 1000)) -- 1002 - 1 - 0.5
        assert.is_nil(cache.life_ms(1, 1000))
    end)

    it("refuses a request of at least the refused cost until the entry ends", function()
        local d = dict()
        local sent = 1000000000
        cache.remember(d, "k", 2, refused, sent, 1000)
        local hit = cache.refusal(d, "k", 2, sent + 100000, 5) -- 100 ms later
        assert.same({ allowed = false, decision = "denied", source = "lua_denial_cache", count = 5, remaining = 0,
                      retry_after_ms = 699, reset_ms = 799, error_code = 0, error = "OK", message = "", limit = 5 }, hit)
        assert.is_nil(cache.refusal(d, "k", 1, sent + 100000, 5), "a smaller cost may fit")
        assert.is_not_nil(cache.refusal(d, "k", 3, sent + 100000, 5))
        assert.is_not_nil(cache.refusal(d, "k", 2, sent + 798000, 5))
        assert.is_nil(cache.refusal(d, "k", 2, sent + 798600, 5), "ended 1.4 ms before the retry time")
        assert.is_nil(cache.refusal(d, "other", 2, sent, 5))
    end)

    it("never reports less than 1 ms to wait", function()
        local d = dict()
        cache.remember(d, "k", 1, refused, 0, 1000)
        -- 1.5 ms before the retry time, the last moment of the entry.
        assert.equals(1, cache.refusal(d, "k", 1, 798500, 5).retry_after_ms)
    end)

    it("keeps no entry for a refusal that ends within 1 ms", function()
        local d = dict()
        cache.remember(d, "k", 1, { count = 1, remaining = 0, retry_after_ms = 1, reset_ms = 1 }, 0, 1000)
        assert.is_nil(next(d.values))
    end)
end)

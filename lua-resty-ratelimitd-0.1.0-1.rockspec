-- The OpenResty client of ratelimitd as a rock: pure Lua, for nginx with
-- the Lua module (OpenResty, or Debian's libnginx-mod-http-lua). The daemon
-- itself ships as the Debian package or through scripts/install.
--   luarocks make lua-resty-ratelimitd-0.1.0-1.rockspec      (from a checkout)
-- tests/rock.rs installs it into a clean tree and runs the seed scenario
-- through nginx with only the tree on the Lua path; it also fails when a
-- module under lua/resty/ is missing from the list below.
package = "lua-resty-ratelimitd"
version = "0.1.0-1"
source = {
   url = "git+https://github.com/ratelimitd/ratelimitd.git",
   tag = "v0.1.0",
}
description = {
   summary = "OpenResty client of ratelimitd: exact, shared rate limits for nginx through a per-host daemon",
   detailed = [[
resty.ratelimitd asks the ratelimitd daemon over its Unix socket whether a
request may pass (exact limits kept in Redis or Redis Cluster, named
policies, fail policies, concurrency leases, refunds), sets the RateLimit
headers and answers 429. resty.ratelimitd.client_key turns the client
address into a key by network prefix (IPv4 /32, IPv6 /64 or configured).
Needs the daemon running on the host.
]],
   homepage = "https://github.com/ratelimitd/ratelimitd",
   license = "Apache-2.0",
}
dependencies = {
   "lua >= 5.1",
}
-- "none" with an install list rather than "builtin": builtin also copies
-- the whole lua/ directory, unit tests (lua/spec) included, into the tree.
build = {
   type = "none",
   install = { lua = {
      ["resty.ratelimitd"] = "lua/resty/ratelimitd.lua",
      ["resty.ratelimitd.cache"] = "lua/resty/ratelimitd/cache.lua",
      ["resty.ratelimitd.client_key"] = "lua/resty/ratelimitd/client_key.lua",
      ["resty.ratelimitd.concurrency"] = "lua/resty/ratelimitd/concurrency.lua",
      ["resty.ratelimitd.config"] = "lua/resty/ratelimitd/config.lua",
      ["resty.ratelimitd.conn"] = "lua/resty/ratelimitd/conn.lua",
      ["resty.ratelimitd.form"] = "lua/resty/ratelimitd/form.lua",
      ["resty.ratelimitd.http"] = "lua/resty/ratelimitd/http.lua",
      ["resty.ratelimitd.kind"] = "lua/resty/ratelimitd/kind.lua",
      ["resty.ratelimitd.share"] = "lua/resty/ratelimitd/share.lua",
      ["resty.ratelimitd.limiter"] = "lua/resty/ratelimitd/limiter.lua",
      ["resty.ratelimitd.limiters"] = "lua/resty/ratelimitd/limiters.lua",
      ["resty.ratelimitd.multi"] = "lua/resty/ratelimitd/multi.lua",
      ["resty.ratelimitd.options"] = "lua/resty/ratelimitd/options.lua",
      ["resty.ratelimitd.policy"] = "lua/resty/ratelimitd/policy.lua",
      ["resty.ratelimitd.refund"] = "lua/resty/ratelimitd/refund.lua",
      ["resty.ratelimitd.request"] = "lua/resty/ratelimitd/request.lua",
      ["resty.ratelimitd.settle"] = "lua/resty/ratelimitd/settle.lua",
      ["resty.ratelimitd.verify"] = "lua/resty/ratelimitd/verify.lua",
      ["resty.ratelimitd.wire"] = "lua/resty/ratelimitd/wire.lua",
   } },
}

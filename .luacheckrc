-- luacheck for the Lua client (lua/) and its unit tests (lua/spec/);
-- scripts/test runs `luacheck lua`.
std = "ngx_lua"
max_line_length = 160
codes = true
files["lua/spec"] = { std = "+busted" }

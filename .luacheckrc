-- luacheck for the Lua client (lua/) and its unit tests (lua/spec/);
-- scripts/test runs `luacheck lua`.
std = "ngx_lua"
max_line_length = 160
codes = true
-- Golden hex and expected messages are kept whole on one line.
files["lua/spec"] = { std = "+busted", max_line_length = false }

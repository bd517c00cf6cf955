# Shared by scripts/demo, scripts/test and scripts/bench: install what is
# missing, and start redis-server and ratelimitd in a temp dir, stopped on exit.
# shellcheck shell=bash

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# apt_install WHAT:PACKAGE ...: installs PACKAGE when WHAT (a command, or an
# absolute path) is missing.
apt_install() {
  local missing=() pair what
  for pair in "$@"; do
    what=${pair%%:*}
    if [[ $what == /* ]]; then
      [ -e "$what" ] || missing+=("${pair#*:}")
    else
      command -v "$what" >/dev/null 2>&1 || missing+=("${pair#*:}")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "installing: ${missing[*]}" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# redis_script NAME: the Redis script NAME (src/redis/scripts/NAME.lua) as
# the daemon runs it: every `--@include FILE` line replaced by that file,
# expanded the same way (build.rs does this for the binary).
redis_script() {
  awk -v dir="$ROOT/src/redis/scripts" '
    function expand(file,    line) {
      while ((getline line < file) > 0) {
        if (line ~ /^--@include /) expand(dir "/" substr(line, 12)); else print line
      }
      close(file)
    }
    BEGIN { expand(dir "/" ARGV[1] ".lua"); exit }' "$1"
}

need_cargo() {
  if ! command -v cargo >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
  fi
  command -v cargo >/dev/null 2>&1 || { echo "cargo not found: install Rust with rustup (https://rustup.rs)" >&2; exit 1; }
}

# free_port: a loopback TCP port nobody listens on.
free_port() {
  local p
  for _ in $(seq 1 200); do
    # Below the usual ephemeral range (32768-60999), which load runs fill.
    p=$((20000 + RANDOM % 12000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  echo "no free port found" >&2
  return 1
}

WORK=$(mktemp -d /tmp/ratelimitd.XXXXXX)
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

# start_redis [ARGS...]: sets REDIS_PORT and REDIS_URL; ARGS go to
# redis-server (e.g. --unixsocket PATH).
start_redis() {
  REDIS_PORT=$(free_port)
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    --logfile "$WORK/redis.log" "$@" &
  PIDS+=($!)
  REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
  for _ in $(seq 1 100); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "redis-server did not start; see $WORK/redis.log" >&2
  return 1
}

# start_daemon BIN: serves on $WORK/ratelimitd.sock against $REDIS_URL; sets
# SOCK. As root, the socket's group is www-data, as Debian's nginx workers need.
# DAEMON_SERVER_EXTRA, if set, is added to its [server] table (keys);
# DAEMON_CONF_EXTRA, if set, is appended to the config (more tables).
start_daemon() {
  SOCK="$WORK/ratelimitd.sock"
  local conf="$WORK/ratelimitd.toml"
  printf '[server]\nlisten = "%s"\nsocket_mode = "0660"\n' "$SOCK" >"$conf"
  [ "$(id -u)" -eq 0 ] && getent group www-data >/dev/null && echo 'socket_group = "www-data"' >>"$conf"
  [ -n "${DAEMON_SERVER_EXTRA:-}" ] && printf '%s\n' "$DAEMON_SERVER_EXTRA" >>"$conf"
  [ -n "${DAEMON_CONF_EXTRA:-}" ] && printf '%s\n' "$DAEMON_CONF_EXTRA" >>"$conf"
  chmod a+rx "$WORK"
  "$1" serve --config "$conf" --redis "$REDIS_URL" 2>"$WORK/ratelimitd.log" &
  PIDS+=($!)
  for _ in $(seq 1 100); do
    [ -S "$SOCK" ] && grep -q "listening" "$WORK/ratelimitd.log" && return 0
    sleep 0.05
  done
  echo "ratelimitd did not start:" >&2
  cat "$WORK/ratelimitd.log" >&2
  return 1
}

# The packages of the whole chain: Redis, nginx with the Lua module, curl.
NGINX_PACKAGES=(nginx:nginx /usr/lib/nginx/modules/ngx_http_lua_module.so:libnginx-mod-http-lua curl:curl)
# The Lua client's unit tests and lint: LuaJIT (Debian's luajit2, OpenResty's
# branch; the package luajit conflicts with libnginx-mod-http-lua), busted,
# luacheck, luarocks (tests/rock.rs installs the rock into a clean tree).
LUA_TEST_PACKAGES=(luajit:luajit2 busted:lua-busted luacheck:lua-check luarocks:luarocks)
# promtool checks the /metrics page (tests/operations.rs).
OPS_TEST_PACKAGES=(promtool:prometheus)
REDIS_PACKAGES=(redis-server:redis-server redis-cli:redis-tools redis-benchmark:redis-tools)

# start_nginx ORDER_WINDOW_MS [EXTRA] [LIMITERS]: runs the shipped
# nginx/ratelimitd.conf and nginx/example.conf against $SOCK, with a stub
# application behind them; sets NGINX_PORT. Only ports, the socket path and
# the /order window are changed; EXTRA (more locations) is added to the
# example's server, LIMITERS (`name = assert(ratelimitd.new{...}),`
# entries: `ratelimitd` is in scope) make the global table `bench_limiters`
# in the example's init_worker_by_lua, after the window is changed.
start_nginx() {
  local prefix="$WORK/nginx" app_port
  NGINX_PORT=$(free_port)
  app_port=$(free_port)
  mkdir -p "$prefix/logs" "$prefix/lua/resty"
  # The client: resty/ratelimitd.lua and its modules in resty/ratelimitd/.
  cp -r "$ROOT/lua/resty/." "$prefix/lua/resty/"
  chmod -R a+rX "$WORK"
  local user=""
  [ "$(id -u)" -eq 0 ] && user="user www-data;"
  {
    echo "load_module /usr/lib/nginx/modules/ndk_http_module.so;"
    echo "load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;"
    echo "$user worker_processes 2; pid $prefix/nginx.pid; error_log $prefix/logs/error.log;"
    echo "events { worker_connections 1024; }"
    echo "http { access_log off; lua_package_path \"$prefix/lua/?.lua;;\";"
    echo "client_body_temp_path $prefix/b; proxy_temp_path $prefix/p; fastcgi_temp_path $prefix/f; uwsgi_temp_path $prefix/u; scgi_temp_path $prefix/s;"
    sed "s#unix:/run/ratelimitd/ratelimitd.sock#unix:$SOCK#" "$ROOT/nginx/ratelimitd.conf"
    local extra=${2:-}
    extra=${extra//$'\n'/ }
    local example
    example=$(sed -e "s#listen 8080;#listen 127.0.0.1:$NGINX_PORT; $extra#" -e "s#server 127.0.0.1:9000;#server 127.0.0.1:$app_port;#" \
        -e "0,/window_ms = 1000,/s//window_ms = $1,/" "$ROOT/nginx/example.conf")
    if [ -n "${3:-}" ]; then
      # The extra limiters go in a table of their own, `bench_limiters`,
      # made in the example's init_worker_by_lua with `ratelimitd` in scope.
      [[ $example == *"init_worker_by_lua_block {"* ]] || { echo "nginx/example.conf has no init_worker_by_lua_block" >&2; return 1; }
      example=${example/"init_worker_by_lua_block {"/"init_worker_by_lua_block { local ratelimitd = require \"resty.ratelimitd\"; bench_limiters = { $3 }"}
    fi
    printf '%s\n' "$example"
    echo "server { listen 127.0.0.1:$app_port; location / { return 200 \"ok\\n\"; } } }"
  } >"$prefix/nginx.conf"
  nginx -p "$prefix" -c "$prefix/nginx.conf" -e "$prefix/logs/error.log" -g 'daemon off;' &
  PIDS+=($!)
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$NGINX_PORT") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nginx did not start:" >&2
  cat "$prefix/logs/error.log" >&2
  return 1
}

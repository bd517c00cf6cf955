# Shared by scripts/demo, scripts/test and scripts/bench: install what is
# missing, and start redis-server and ratelimitd in a temp dir, stopped on exit.
# shellcheck shell=bash

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# apt_install CMD:PACKAGE ...: installs PACKAGE when CMD is not on PATH.
apt_install() {
  local missing=() pair
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "installing: ${missing[*]}" >&2
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
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
    p=$((20000 + RANDOM % 30000))
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

# start_redis: sets REDIS_PORT and REDIS_URL.
start_redis() {
  REDIS_PORT=$(free_port)
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" \
    --logfile "$WORK/redis.log" &
  PIDS+=($!)
  REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"
  for _ in $(seq 1 100); do
    redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "redis-server did not start; see $WORK/redis.log" >&2
  return 1
}

# start_daemon BIN: serves on $WORK/ratelimitd.sock against $REDIS_URL; sets SOCK.
start_daemon() {
  SOCK="$WORK/ratelimitd.sock"
  "$1" serve --listen "$SOCK" --redis "$REDIS_URL" 2>"$WORK/ratelimitd.log" &
  PIDS+=($!)
  for _ in $(seq 1 100); do
    [ -S "$SOCK" ] && grep -q "listening" "$WORK/ratelimitd.log" && return 0
    sleep 0.05
  done
  echo "ratelimitd did not start:" >&2
  cat "$WORK/ratelimitd.log" >&2
  return 1
}

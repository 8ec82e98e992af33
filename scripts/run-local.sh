#!/usr/bin/env bash
# Starts the whole stack in the foreground: Redis (unless REDIS_URL is given), the sidecar, a demo
# upstream and Envoy with the filter. Ctrl-C stops all of them. Run through `make run`.
#   listener 127.0.0.1:10000, Envoy admin 127.0.0.1:9901, sidecar 127.0.0.1:8081, upstream 127.0.0.1:8080
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_CONFIG="${ENVOY_CONFIG:-envoy/envoy.yaml}"
ENVOY_BIN="${ENVOY_BIN:-.venv/bin/envoy}"
SIDECAR_BIN="${SIDECAR_BIN:-target/release/ratelimit-sidecar}"
LIMITS="${LIMITS:-envoy/limits.yaml}"
LOG_DIR="${LOG_DIR:-run}"
mkdir -p "$LOG_DIR"

pids=()
cleanup() {
  trap - INT TERM EXIT
  echo; echo "stopping..."
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup INT TERM EXIT

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_for() { # name, command...
  local name=$1; shift
  for _ in $(seq 1 300); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "run: $name did not become ready; see $LOG_DIR/" >&2; exit 1
}

for port in 8080 8081 9901 10000; do
  if port_busy "$port"; then echo "run: port $port is in use; stop what holds it first" >&2; exit 1; fi
done

if [ -z "${REDIS_URL:-}" ]; then
  if port_busy 6379; then
    echo "run: using the Redis already on 127.0.0.1:6379"
  else
    redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no \
      --maxmemory-policy noeviction >"$LOG_DIR/redis.log" 2>&1 &
    pids+=($!)
    wait_for redis redis-cli -p 6379 ping
  fi
  REDIS_URL=redis://127.0.0.1:6379
fi

RUST_LOG="${RUST_LOG:-info}" "$SIDECAR_BIN" --listen 127.0.0.1:8081 --redis "$REDIS_URL" \
  --limits "$LIMITS" >"$LOG_DIR/sidecar.log" 2>&1 &
pids+=($!)
wait_for sidecar curl -sf http://127.0.0.1:8081/readyz

python3 scripts/demo_upstream.py 8080 >"$LOG_DIR/upstream.log" 2>&1 &
pids+=($!)

"$ENVOY_BIN" -c "$ENVOY_CONFIG" --concurrency 2 --disable-hot-restart -l info \
  >"$LOG_DIR/envoy.log" 2>&1 &
pids+=($!)
wait_for envoy curl -sf http://127.0.0.1:9901/ready

cat <<TXT
ratelimit stack is up (logs in $LOG_DIR/):
  Envoy      http://127.0.0.1:10000   (config $ENVOY_CONFIG)
  admin      http://127.0.0.1:9901/stats?filter=wasmcustom
  sidecar    http://127.0.0.1:8081/metrics   (limits: $LIMITS, edit it: reloaded live)
  Redis      $REDIS_URL
Try (about 100 pass, then 429):
  curl -s -o /dev/null -w '%{http_code}\\n' -H 'x-api-key: alpha-key' 'http://127.0.0.1:10000/api/hello?n=[1-150]' | uniq -c
Ctrl-C stops everything.
TXT
wait -n "${pids[@]}"
echo "run: a process exited; see $LOG_DIR/" >&2

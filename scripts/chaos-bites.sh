#!/usr/bin/env bash
# Shows that `make chaos` bites: reverts one fix at a time (tests/bites/<name>.patch, each the
# smallest change that undoes a fix of docs/failure-behaviour.md's table "What it finds"), builds
# the part it lives in, and runs make chaos's binary from seed 1 until the first violation (at
# most BITES_SEEDS seeds of 60 s, shrunk unless BITES_NO_SHRINK=1). Run through
# `make chaos-bites [BITES=name,...]`; the fixed build comes from `make build`.
#
# The reverted tree is a git worktree of HEAD under target/bites/tree with a target dir of its
# own (target/bites/target), so the checkout and its build are never touched. One summary line
# per fix in target/bites/summary.txt; each run's report in target/bites/<name>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

SEEDS="${BITES_SEEDS:-8}"
OUT=target/bites
TREE="$OUT/tree"
CHAOS=target/release/ratelimit-chaos
FIXED_SIDECAR=target/release/ratelimit-sidecar
FIXED_WASM=target/wasm32-wasip1/release/ratelimit_filter.wasm
for f in "$CHAOS" "$FIXED_SIDECAR" "$FIXED_WASM"; do
  [ -f "$f" ] || { echo "chaos-bites: $f is missing: run make build and make chaos first" >&2; exit 1; }
done

if [ -n "${BITES:-}" ]; then
  IFS=, read -r -a names <<< "$BITES"
else
  names=()
  for p in tests/bites/*.patch; do names+=("$(basename "$p" .patch)"); done
fi

mkdir -p "$OUT"
git worktree remove --force "$TREE" 2>/dev/null || true
git worktree add --detach --force "$TREE" HEAD >/dev/null
trap 'git worktree remove --force "$TREE" 2>/dev/null || true' EXIT
shrink=()
[ "${BITES_NO_SHRINK:-0}" = 1 ] && shrink=(--no-shrink)

for name in "${names[@]}"; do
  patch="tests/bites/$name.patch"
  [ -f "$patch" ] || { echo "chaos-bites: no $patch" >&2; exit 1; }
  git -C "$TREE" checkout -q .
  git -C "$TREE" apply "$PWD/$patch"
  sidecar="$PWD/$FIXED_SIDECAR"
  wasm="$PWD/$FIXED_WASM"
  if grep -q '^+++ b/filter/' "$patch"; then
    (cd "$TREE" && CARGO_TARGET_DIR="$PWD/../target" cargo build -q --release -p ratelimit-filter --target wasm32-wasip1)
    wasm="$PWD/$OUT/target/wasm32-wasip1/release/ratelimit_filter.wasm"
  else
    (cd "$TREE" && CARGO_TARGET_DIR="$PWD/../target" cargo build -q --release -p ratelimit-sidecar)
    sidecar="$PWD/$OUT/target/release/ratelimit-sidecar"
  fi
  start=$(date +%s)
  set +e
  RATELIMIT_SIDECAR_BIN="$sidecar" RATELIMIT_FILTER_WASM="$wasm" \
    "$CHAOS" --first 1 --seeds "$SEEDS" "${shrink[@]}" > "$OUT/$name.txt" 2>&1
  set -e
  minutes=$(( ($(date +%s) - start) / 60 ))
  found=$(grep -m1 'violated after' "$OUT/$name.txt" || echo "not found in $SEEDS seeds")
  echo "$name: $found (this run: $minutes min)" | tee -a "$OUT/summary.txt"
done

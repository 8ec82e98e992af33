#!/usr/bin/env bash
# `make kubernetes`: the manifests of envoy/kubernetes/ with the images named, ready for
# `kubectl apply -f` (docs/kubernetes.md). Writes OUT (target/kubernetes by default).
#   SIDECAR_IMAGE  the sidecar's image, as pushed (required)
#   FILTER_IMAGE   the filter's Wasm OCI image (`make oci`), as pushed (required)
#   ENVOY_IMAGE    the gateway's Envoy (default envoyproxy/envoy:v1.40.0, the version tested)
#   REDIS_IMAGE    the trial Redis (default redis:7.0.15-alpine)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-target/kubernetes}"
export ENVOY_IMAGE="${ENVOY_IMAGE:-envoyproxy/envoy:v1.40.0}"
export REDIS_IMAGE="${REDIS_IMAGE:-redis:7.0.15-alpine}"
missing=()
[ -n "${SIDECAR_IMAGE:-}" ] || missing+=("SIDECAR_IMAGE=<registry>/ratelimit-sidecar:<tag>")
[ -n "${FILTER_IMAGE:-}" ] || missing+=("FILTER_IMAGE=<registry>/ratelimit-filter:<tag>")
if [ ${#missing[@]} -gt 0 ]; then
  echo "kubernetes: name the images you pushed: make kubernetes ${missing[*]} (docs/kubernetes.md)" >&2
  exit 2
fi
export SIDECAR_IMAGE FILTER_IMAGE
mkdir -p "$OUT"
python3 - "$OUT" envoy/kubernetes/*.yaml <<'PY'
import os, re, sys
out, files = sys.argv[1], sys.argv[2:]
for path in files:
    text = open(path).read()
    def value(m):
        return os.environ[m.group(1)]
    text = re.sub(r"\$\{(SIDECAR_IMAGE|FILTER_IMAGE|ENVOY_IMAGE|REDIS_IMAGE)\}", value, text)
    left = re.findall(r"\$\{[A-Z_]+\}", text)
    if left:
        sys.exit(f"kubernetes: {path} names {left}, which nothing sets")
    with open(os.path.join(out, os.path.basename(path)), "w") as f:
        f.write(text)
PY
echo "kubernetes: $OUT/ ($(cd "$OUT" && ls | tr '\n' ' ')): kubectl apply -f $OUT/"

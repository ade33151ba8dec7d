#!/usr/bin/env bash
# Build the Docker sandbox's base image locally, with no registry: a Debian bookworm minbase root filesystem
# (debootstrap) with Python 3, pytest (tasks are graded with pytest inside the sandbox), `python` pointing at
# python3, and procps; then `docker import`. Needs root, debootstrap and a Debian mirror (apt's).
#
#   launch/docker/build_image.sh [IMAGE]        # default agentic-rl/python:bookworm
#
# Idempotent and cached: the image is labelled with a hash of this recipe and left alone when the engine already
# has it; the root filesystem tarball is kept in $AGENTIC_RL_CACHE (default ~/.cache/agentic-rl/docker), so a
# fresh engine imports it in seconds instead of running debootstrap again (about a minute).
# Environment: DOCKER_HOST (the engine), DEBIAN_MIRROR (default: deb.debian.org), SUITE (default bookworm).
set -euo pipefail

IMAGE=${1:-agentic-rl/python:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3-minimal,python3,python3-pytest,python-is-python3,procps
CACHE=${AGENTIC_RL_CACHE:-$HOME/.cache/agentic-rl/docker}
RECIPE=$(printf '%s\n' "$SUITE" "$PACKAGES" "v3" | sha256sum | cut -c1-16)

command -v docker >/dev/null || { echo "build_image.sh: no docker client (apt-get install -y docker.io)" >&2; exit 2; }
if [ "$(docker image inspect -f '{{index .Config.Labels "org.agentic-rl.recipe"}}' "$IMAGE" 2>/dev/null)" = "$RECIPE" ]; then
  echo "build_image.sh: $IMAGE is up to date (recipe $RECIPE)"
  exit 0
fi

old_image=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
tarball="$CACHE/rootfs-$SUITE-$RECIPE.tar"
if [ ! -s "$tarball" ]; then
  [ "$(id -u)" = 0 ] || { echo "build_image.sh: debootstrap needs root" >&2; exit 2; }
  command -v debootstrap >/dev/null || { echo "build_image.sh: no debootstrap (apt-get install -y debootstrap)" >&2; exit 2; }
  mkdir -p "$CACHE"
  rootfs=$(mktemp -d "${TMPDIR:-/tmp}/agentic-rl-rootfs.XXXXXX")
  # Never follow a mount debootstrap may have left behind (proc, sys) when it failed half way.
  cleanup() {
    grep -o " $rootfs/[^ ]*" /proc/mounts | sort -r | xargs -r umount -l 2>/dev/null || true
    rm -rf --one-file-system "$rootfs"
  }
  trap cleanup EXIT
  echo "build_image.sh: debootstrap $SUITE ($PACKAGES) from $MIRROR"
  # Two stages, so that dpkg can be told, before it installs anything, to skip fsync and documentation
  # (a third less time than one `debootstrap` call on our CI machines).
  log="$CACHE/debootstrap.log"
  debootstrap --foreign --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$log" 2>&1 \
    || { tail -20 "$log" >&2; exit 1; }
  mkdir -p "$rootfs/etc/dpkg/dpkg.cfg.d"
  printf '%s\n' force-unsafe-io path-exclude=/usr/share/doc/* path-exclude=/usr/share/man/* \
    path-exclude=/usr/share/info/* path-exclude=/usr/share/locale/* path-include=/usr/share/locale/C.* \
    path-exclude=/usr/share/lintian/* >"$rootfs/etc/dpkg/dpkg.cfg.d/01-sandbox-image"
  chroot "$rootfs" /debootstrap/debootstrap --second-stage >>"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
  rm -f "$rootfs/etc/dpkg/dpkg.cfg.d/01-sandbox-image"
  # Nothing the sandbox needs: package caches, lists, docs, man pages, locales.
  rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
         "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/* "$rootfs"/tmp/*
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C.*' ! -name locale.alias -exec rm -rf {} +
  mkdir -p "$rootfs/workspace"
  tar -C "$rootfs" --numeric-owner -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi

docker import \
  --change "ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8" \
  --change "WORKDIR /workspace" \
  --change "LABEL org.agentic-rl.recipe=$RECIPE" \
  --change 'CMD ["/bin/sh"]' \
  "$tarball" "$IMAGE" >/dev/null
docker run --rm --network none "$IMAGE" python -m pytest --version >/dev/null 2>&1 \
  || { echo "build_image.sh: $IMAGE cannot run pytest" >&2; exit 1; }
# Older recipes: their tarballs, and the image this one replaces (unless a container still uses it).
find "$CACHE" -maxdepth 1 -name "rootfs-*.tar" ! -name "$(basename "$tarball")" -delete
[ -z "$old_image" ] || docker image rm "$old_image" >/dev/null 2>&1 || true
echo "build_image.sh: built $IMAGE (recipe $RECIPE, $(du -h "$tarball" | cut -f1) root filesystem)"

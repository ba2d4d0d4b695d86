#!/usr/bin/env bash
# Build raycluster's images offline: a Debian base (debootstrap + docker import), the lab host image
# and the Ray node image (from a wheelhouse made on this machine). Each step is skipped when done.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
DOCKER=${DOCKER:-$(command -v /usr/bin/docker || command -v docker)}
BASE_IMAGE=${BASE_IMAGE:-raycluster/debian-base:bookworm}
NODE_IMAGE=${NODE_IMAGE:-raycluster/node:0.1.0}
LAB_IMAGE=${LAB_IMAGE:-raycluster/labhost:0.1.0}
LAB_PODMAN_IMAGE=${LAB_PODMAN_IMAGE:-raycluster/labhost-podman:0.1.0}
PYTHON=${PYTHON:-python3}
# The Ray version lives in one place, raycluster_cli/versions.py (doctor checks images against it).
RAY_VERSION=$(sed -n 's/^RAY_VERSION = "\(.*\)"/\1/p' raycluster_cli/versions.py)
TORCH_VERSION=2.13.0
log() { echo "[build-images] $*" >&2; }

if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
  # The mirror this machine's apt uses (DEBIAN_MIRROR=URL overrides); see scripts/debian-mirror.sh.
  mirror=$(bash scripts/debian-mirror.sh)
  rootfs=$(mktemp -d /tmp/raycluster-rootfs.XXXXXX)
  log "debootstrap bookworm from $mirror into $rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/tmp/raycluster-debootstrap.log 2>&1 \
    || { tail -20 /tmp/raycluster-debootstrap.log >&2; exit 1; }
  tar -C "$rootfs" -c . | "$DOCKER" import - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  log "imported $BASE_IMAGE"
fi

# Docker sends no symlinked folder in a build context: a worktree whose .cache links to another checkout's
# gets a real folder of hard links to the same wheels instead.
if [ -L .cache ]; then
  shared=$(readlink -f .cache)
  rm .cache && mkdir -p .cache/wheelhouse
  cp -al "$shared/wheelhouse/." .cache/wheelhouse/ 2>/dev/null || cp -a "$shared/wheelhouse/." .cache/wheelhouse/
fi
mkdir -p .cache/wheelhouse
# The node image's Python packages: Ray with its dashboard and Serve (the service), torch (the stages), and
# transformers (tokenizers and chat templates for `serve`), diffusers (image generation's checkpoints).
NODE_PACKAGES=("ray[default,serve]==$RAY_VERSION" "torch==$TORCH_VERSION" numpy "transformers>=5.0" "diffusers>=0.30")
if ! ls .cache/wheelhouse/ray-"$RAY_VERSION"-*.whl .cache/wheelhouse/torch-"$TORCH_VERSION"*.whl \
    .cache/wheelhouse/transformers-*.whl .cache/wheelhouse/fastapi-*.whl .cache/wheelhouse/diffusers-*.whl \
    >/dev/null 2>&1; then
  log "downloading the wheelhouse"
  "$PYTHON" -m pip download -q "${NODE_PACKAGES[@]}" -d .cache/wheelhouse
fi

build() {  # build IMAGE DOCKERFILE
  log "building $1"
  DOCKER_BUILDKIT=0 "$DOCKER" build -q --network host --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg RAY_VERSION="$RAY_VERSION" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    -t "$1" -f "$2" . >/dev/null
}
# Always build: cached layers make an unchanged image a no-op, and a changed one is rebuilt.
build "$LAB_IMAGE" docker/labhost/Dockerfile
build "$LAB_PODMAN_IMAGE" docker/labhost-podman/Dockerfile  # lab hosts whose engine is Podman
build "$NODE_IMAGE" docker/node/Dockerfile
log "images ready: $LAB_IMAGE $LAB_PODMAN_IMAGE $NODE_IMAGE"

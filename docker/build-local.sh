#!/usr/bin/env bash
# Build SAO Lab's image on a machine that reaches Debian's and PyPI's package servers but no image registry.
#   docker/build-local.sh
#   docker compose -f docker-compose.yml -f docker/compose.embedded-broker.yml up
# 1. base image: Debian bookworm (python3, venv) made by debootstrap and `docker import` (needs root), unless it exists
# 2. docker/wheels/: the CPU torch wheel, downloaded on the host (the registry's Linux torch is the CUDA build)
# 3. the project image on that base, pip reaching PyPI through the host's network with the host's CA bundle as a
#    build secret (never stored in a layer)
# The embedded-broker override runs the project image itself as the broker (`sao broker`): no broker image to build.
# Settings (environment): SAO_IMAGE (sao-lab:latest), SAO_BASE_IMAGE (sao-base:bookworm), SAO_CA_BUNDLE
# (/etc/ssl/certs/ca-certificates.crt), DEBIAN_MIRROR (http://deb.debian.org/debian), PYTHON (.venv/bin/python or
# python3: its pip downloads the wheel), TORCH_VERSION (2.13.0), EXTRAS (none; e.g. megatron,ray).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${SAO_IMAGE:-sao-lab:latest}
BASE=${SAO_BASE_IMAGE:-sao-base:bookworm}
CA=${SAO_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH=${TORCH_VERSION:-2.13.0}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
say() { echo "build-local: $*" >&2; }

# BuildKit (secrets, bind mounts): buildx when installed, else the BuildKit built into Debian's docker.io 20.10 CLI
DOCKER=docker
if ! docker buildx version >/dev/null 2>&1; then
    if [ -x /usr/bin/docker ] && /usr/bin/docker version --format '{{.Client.Version}}' 2>/dev/null | grep -q '^20\.'; then
        DOCKER=/usr/bin/docker
    else
        say "needs BuildKit: install docker-buildx, or Debian's docker.io (20.10) whose CLI has it built in"; exit 1
    fi
fi

t0=$(date +%s)
if $DOCKER image inspect "$BASE" >/dev/null 2>&1; then
    say "base image $BASE exists"
else
    command -v debootstrap >/dev/null || { say "needs debootstrap (apt-get install debootstrap)"; exit 1; }
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    say "debootstrap bookworm into $root (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" >/dev/null
    tar -C "$root" -c . | $DOCKER import --change 'ENV LANG=C.UTF-8' - "$BASE" >/dev/null
    rm -rf "$root"
    trap - EXIT
    say "base image $BASE made"
fi

if ls docker/wheels/torch-"$TORCH"*.whl >/dev/null 2>&1; then
    say "torch wheel present: $(ls docker/wheels/torch-"$TORCH"*.whl)"
else
    say "downloading torch==$TORCH (CPU wheel) into docker/wheels"
    "$PY" -m pip download -q "torch==$TORCH" --no-deps -d docker/wheels
fi

secret=()
[ -s "$CA" ] && secret=(--secret "id=ca,src=$CA")
say "building $IMAGE on $BASE"
DOCKER_BUILDKIT=1 $DOCKER build --network host "${secret[@]}" --build-arg BASE_IMAGE="$BASE" \
    --build-arg EXTRAS="${EXTRAS:-}" -t "$IMAGE" .
size=$($DOCKER image inspect -f '{{.Size}}' "$IMAGE")
say "$IMAGE: $((size / 1000000)) MB, built in $(( $(date +%s) - t0 )) s"

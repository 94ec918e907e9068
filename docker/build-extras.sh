#!/usr/bin/env bash
# Add optional extras of pyproject.toml (megatron, ray) to a built project image, as one thin layer on top of it:
#   docker/build-local.sh && docker/build-extras.sh megatron      # sao-lab:latest -> sao-lab:megatron
# Quicker than building the whole image again with --build-arg EXTRAS=... (the dependency layer stays the base
# image's). The pinned versions come from the pyproject.toml inside the base image; pip reaches PyPI through the
# host's network with the host's CA bundle as a build secret (never stored in a layer), as docker/build-local.sh.
# Settings (environment): SAO_IMAGE (the base, sao-lab:latest), SAO_EXTRAS_IMAGE (default: the base's name, tagged
# with the extras joined by "-"), SAO_CA_BUNDLE (/etc/ssl/certs/ca-certificates.crt).
set -euo pipefail
EXTRAS=${1:?usage: docker/build-extras.sh EXTRA[,EXTRA...]   e.g. megatron}
IMAGE=${SAO_IMAGE:-sao-lab:latest}
OUT=${SAO_EXTRAS_IMAGE:-${IMAGE%:*}:${EXTRAS//,/-}}
CA=${SAO_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
say() { echo "build-extras: $*" >&2; }

DOCKER=docker  # BuildKit (the secret mount): buildx when installed, else Debian's docker.io 20.10 CLI
if ! docker buildx version >/dev/null 2>&1 && [ -x /usr/bin/docker ]; then
    DOCKER=/usr/bin/docker
fi
secret=()
[ -s "$CA" ] && secret=(--secret "id=ca,src=$CA")
t0=$(date +%s)
DOCKER_BUILDKIT=1 $DOCKER build --network host "${secret[@]}" -t "$OUT" - <<EOF
FROM $IMAGE
USER root
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    python -c "import sys, tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
print('\n'.join(d for e in sys.argv[1].split(',') for d in p['optional-dependencies'][e]))" "$EXTRAS" \
        > /tmp/extras.txt \
    && pip install -r /tmp/extras.txt && rm /tmp/extras.txt
USER sao
EOF
say "$OUT ($EXTRAS on $IMAGE) built in $(( $(date +%s) - t0 )) s"

# SAO Lab project image: every role runs as `sao <command>` (see docker-compose.yml).
#   docker build -t sao-lab .                                  # public base image, CPU torch (default)
#   docker build --build-arg CUDA=cu128 -t sao-lab:cu128 .      # CUDA torch wheels
#   docker build --build-arg EXTRAS=megatron,ray -t sao-lab .   # optional backends
# Restricted networks (docker/build-local.sh does all of this):
#   --build-arg BASE_IMAGE=...   any image with python3 (>= 3.11) and its venv module, e.g. made by debootstrap
#   docker/wheels/*.whl          wheels installed first and preferred over the index (e.g. the CPU torch wheel)
#   --secret id=ca,src=FILE      an extra CA bundle for pip (a proxy's); mounted for the install steps only,
#                                never written to a layer. Needs BuildKit (DOCKER_BUILDKIT=1 or buildx).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# cpu, or a CUDA wheel tag of the PyTorch index (cu126, cu128, ...)
ARG CUDA=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl
# optional extras of pyproject.toml, comma-separated (megatron, ray); empty: none
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A virtual environment works the same on python:*-slim and on a bare Debian python3.
RUN python3 -m venv /opt/venv

# torch first, so the project's open torch range is already met: a local wheel when given, else the PyTorch index
# (docker/wheels is bind-mounted, not copied: a 190 MB wheel does not stay in a layer)
RUN --mount=type=secret,id=ca --mount=type=bind,source=docker/wheels,target=/tmp/wheels \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    if ls /tmp/wheels/torch-${TORCH_VERSION}*.whl >/dev/null 2>&1; then \
        pip install /tmp/wheels/torch-${TORCH_VERSION}*.whl; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}/${CUDA}" --extra-index-url https://pypi.org/simple; \
    fi

WORKDIR /src
# The dependencies (from pyproject.toml alone) before the sources: editing the code rebuilds only the last layers
COPY pyproject.toml ./
RUN --mount=type=secret,id=ca --mount=type=bind,source=docker/wheels,target=/tmp/wheels \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extras = [e for e in sys.argv[1].split(',') if e]; \
print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" "${EXTRAS}" \
        > /tmp/requirements.txt \
    && pip install --find-links /tmp/wheels -r /tmp/requirements.txt
COPY README.md ./
COPY simulator simulator
COPY streamer streamer
COPY learner learner
COPY dashboard dashboard
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install --no-deps . \
    && python -c "import torch, faust, streamer.launch.cli; print('torch', torch.__version__)"

# Non-root user; /app/runs becomes the shared volume (runs, their published weights and the warm-start cache;
# a new named volume takes the ownership of the folder it is mounted on).
RUN useradd --create-home --uid 1000 sao \
    && mkdir -p /app/runs /config \
    && chown -R sao:sao /app
COPY --chown=sao:sao docker/run.yaml /app/run.yaml
USER sao
WORKDIR /app
ENV SAO_BOOTSTRAP=kafka:9092 \
    SAO_RUN=demo

ENTRYPOINT ["sao"]
CMD ["--help"]

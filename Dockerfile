# SAO Lab project image: every role runs as `sao <command>` (see docker-compose.yml).
#   docker build -t sao-lab .                                  # CPU torch (default)
#   docker build --build-arg CUDA=cu128 -t sao-lab:cu128 .      # CUDA torch wheels
#   docker build --build-arg EXTRAS=megatron,ray -t sao-lab .   # optional backends
FROM python:3.11-slim

# cpu, or a CUDA wheel tag of the PyTorch index (cu126, cu128, ...)
ARG CUDA=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl
# optional extras of pyproject.toml, comma-separated (megatron, ray); empty: none
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the PyTorch index, so the project's open torch range is already met
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}/${CUDA}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY simulator simulator
COPY streamer streamer
COPY learner learner
COPY dashboard dashboard
RUN if [ -n "${EXTRAS}" ]; then pip install ".[${EXTRAS}]"; else pip install .; fi \
    && python -c "import torch, faust, streamer.launch.cli; print('torch', torch.__version__)"

# Non-root user; /app/runs and /app/weights become the shared volumes (a new named volume takes
# the ownership of the folder it is mounted on).
RUN useradd --create-home --uid 1000 sao \
    && mkdir -p /app/runs /app/weights /config \
    && chown -R sao:sao /app
COPY --chown=sao:sao docker/learner.yaml /app/learner.yaml
USER sao
WORKDIR /app
ENV SAO_BOOTSTRAP=kafka:9092 \
    SAO_RUN=demo

ENTRYPOINT ["sao"]
CMD ["--help"]

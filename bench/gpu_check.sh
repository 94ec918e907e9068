#!/usr/bin/env bash
# GPU check of the megatron backend: NCCL, expert parallelism across the GPUs present, bf16.
# Prints step time, tokens/s and model FLOP utilisation; saves runs/bench/gpu_check.json.
#   bash bench/gpu_check.sh                  # all GPUs, EP = number of GPUs (must divide 16 experts)
#   EP=2 SEQ=2048 bash bench/gpu_check.sh    # overrides; PEAK_TFLOPS=... for GPUs not in the table
# Model: bench/megatron_step.py --size gpu (8 layers, hidden 1024, 16 experts top-2, width 1024).
# On CPU-only machines it stops: the CPU path is tested by tests/test_megatron_backend.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 1 ]; then
  echo "gpu_check: no CUDA device visible; nothing to check (CPU parity: pytest tests/test_megatron_backend.py)" >&2
  exit 2
fi
EP=${EP:-$NGPU}
BATCH=${BATCH:-$((8 * NGPU))}
SEQ=${SEQ:-1024}
PEAK=${PEAK_TFLOPS:+--peak-tflops $PEAK_TFLOPS}
"$PY" -c "import torch; print('gpus:', [torch.cuda.get_device_name(i) for i in range($NGPU)], 'torch', torch.__version__)"
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" bench/megatron_step.py --worker \
  --ep "$EP" --size gpu --dtype bfloat16 --batch "$BATCH" --seq "$SEQ" --steps 10 --warmup 3 \
  $PEAK --out runs/bench/gpu_check.json
echo "saved runs/bench/gpu_check.json"

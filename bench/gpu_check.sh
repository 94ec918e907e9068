#!/usr/bin/env bash
# GPU check of the megatron backend: NCCL, expert parallelism across the GPUs present, bf16.
# Prints step time, tokens/s and model FLOP utilisation; saves runs/bench/gpu_check.json.
#   bash bench/gpu_check.sh                  # all GPUs, EP = number of GPUs (must divide 16 experts)
#   EP=2 SEQ=2048 bash bench/gpu_check.sh    # overrides; PEAK_TFLOPS=... for GPUs not in the table
#   VLLM_PY=~/vllm-env/bin/python bash bench/gpu_check.sh   # also the vLLM engine (SKIP_MEGATRON=1: only it)
# Model: bench/megatron_step.py --size gpu (8 layers, hidden 1024, 16 experts top-2, width 1024).
# On CPU-only machines it stops: the CPU path is tested by tests/test_megatron_backend.py.
# Last, suite 2.1's tuning pilot for 8 minutes (SKIP_PILOT=1 skips it; PILOT_BUDGET_S=... changes it).
# A GPU machine with its own CUDA torch and no package registry: download the pinned wheels it lacks for its Python
# elsewhere (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ...`:
# msgspec, kafka-python, crc32c, lz4, transformers, huggingface-hub, tokenizers, megatron-core at pyproject.toml's
# pins), `pip install --no-index --no-deps --target /tmp/site` there, then
# `PYTHONPATH=/tmp/site:$PWD PY=python3 bash bench/gpu_check.sh`; carry runs/cache to skip the warm start's build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || command -v "$PY" >/dev/null || { echo "gpu_check: no python at $PY (set PY=...)" >&2; exit 2; }
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
if [ "${SKIP_MEGATRON:-0}" != 1 ]; then
# Expected (not measured yet): the line's label ends in "(cuda)" (NCCL: the backend picks it whenever CUDA is
# present) and MFU is a percentage, not "n/a" (H100/H200/A100 are in bench/megatron_step.py's peak table; others
# need PEAK_TFLOPS). The model: 423.9M parameters (402.7M in experts), 5.30e8 FLOPs a token at SEQ 1024. As a
# guide, this small model on the local spec (one GEMM per expert, no fusion) should land at a few % to ~20% MFU.
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" bench/megatron_step.py --worker \
  --ep "$EP" --size gpu --dtype bfloat16 --batch "$BATCH" --seq "$SEQ" --steps 10 --warmup 3 \
  $PEAK --out runs/bench/gpu_check.json
echo "saved runs/bench/gpu_check.json"
# the learner's whole step as `sao learn --backend megatron` runs it (critic + policy, batch on the GPU)
"$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" bench/megatron_step.py --worker --trainer \
  --ep "$EP" --size gpu --dtype bfloat16 --batch "$BATCH" --seq "$SEQ" --steps 10 --warmup 3 \
  $PEAK --out runs/bench/gpu_check_learner.json
echo "saved runs/bench/gpu_check_learner.json"
# the policy step at every layout of bench/megatron_step.py's LAYOUTS that fits the GPUs present (TP, PP, EP,
# ZeRO-1; one GPU: the 1-rank row only): tokens/s, MFU, peak memory per rank (torch.cuda.max_memory_allocated),
# beside the CPU figures of docs/results/megatron_step.json
# Expected: every row that fits runs; weights and AdamW state per rank fall as in the CPU rows (EP 2 halves the
# experts', ZeRO-1 halves the state at DP 2, TP 2 and PP 2 halve the dense or the layers').
"$PY" bench/megatron_step.py --layouts --size gpu --dtype bfloat16 --batch "$BATCH" --seq "$SEQ" --steps 10 \
  --warmup 3 $PEAK --out docs/results/megatron_step_gpu.json
# What the backend leaves to a GPU (bench/megatron_gpu_paths.py, tests/test_megatron_gpu_paths.py): the same model
# through megatron-core's DDP and optimizer, with the local spec, then the TransformerEngine spec with grouped GEMM
# (where transformer_engine imports; else the local spec again, named so in the line), then the TE spec with
# megatron-core's DistributedOptimizer. Each prints step time, tok/s, MFU, peak and optimizer MiB per rank, and a
# "megatron_gpu_paths: PASS" line: the step ran with a finite gradient norm, on NCCL, with the TE spec where it is
# installed, and Adam's memory per rank within 10% + 64 MiB of its arithmetic (12 bytes a parameter, bf16 params
# with fp32 main params and moments, over the ranks that share it with the DistributedOptimizer). Expected MiB per
# rank at EP = GPUs: 4,851 on 1 GPU (all three runs: DP 1 shards nothing); 2,547 replicated / 2,425 distributed on
# 2 GPUs; 819 / 606 on 8 (the experts are not replicated at EP = GPUs; the dense part shards over DP). Expected
# speed: the TE spec's tok/s above the local spec's (grouped GEMM). Into docs/results/megatron_gpu_paths*.json beside
# megatron_step_gpu.json; a FAIL or a crash is reported and the rest runs.
for GP in "--local-spec" "" "--dist-opt"; do
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" bench/megatron_gpu_paths.py --ep "$EP" \
    --size gpu --dtype bfloat16 --batch "$BATCH" --seq "$SEQ" --steps 10 --warmup 3 $PEAK $GP \
    --out "docs/results/megatron_gpu_paths${GP:+_${GP#--}}.json" \
    || echo "gpu_check: bench/megatron_gpu_paths.py $GP failed" >&2
done
fi

# vLLM engine (learner/engines/vllm.py). vLLM pins its own torch/transformers, so it usually lives in its own
# environment: VLLM_PY=/path/to/vllm-env/bin/python (that env: pip install -e '.[vllm,dev]'). Runs the GPU tests
# of the engine (generation, log-probs vs the learner at fp32, in-place reload) and the log-prob mismatch bench
# at bfloat16 (what rollouts use) and float32. SKIP_MEGATRON=1 runs only this part.
VLLM_PY=${VLLM_PY:-$PY}
if "$VLLM_PY" -c "import vllm" 2>/dev/null; then
  "$VLLM_PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  "$VLLM_PY" -m pytest tests/test_vllm_engine.py -q -rs
  "$VLLM_PY" bench/logprob_mismatch.py --engine vllm --vllm "dtype=bfloat16" --out runs/bench/logprob_mismatch_vllm_bf16.json
  "$VLLM_PY" bench/logprob_mismatch.py --engine vllm --vllm "dtype=float32 enforce_eager=true" \
    --out runs/bench/logprob_mismatch_vllm_fp32.json
else
  echo "gpu_check: vllm not importable by $VLLM_PY; vLLM checks skipped (set VLLM_PY to the python of a vllm env)" >&2
fi

# Your own model on a GPU: a randomly initialised ~0.5B GLM-4-MoE (494M parameters: hidden 1536, 20 layers, a dense
# first layer, 4 routed experts top-2 and a shared expert; BPE tokenizer and chat template built locally by
# `sao toy-model`), served by vLLM to answer 128 rows of examples/own-model/stream.jsonl, then trained for a few
# steps by the megatron learner in bfloat16 (EP over 2 GPUs when there are 2 or more: 4 experts). The same commands
# ran on CPU with a 3-layer model, the torch engine and gloo (EP 2). Saves runs/bench/gpu_own_model/.
if "$VLLM_PY" -c "import vllm" 2>/dev/null && [ "${SKIP_OWN_MODEL:-0}" != 1 ]; then
  OWN=runs/bench/gpu_own_model
  OWN_NPROC=$(( NGPU >= 2 ? 2 : 1 ))
  rm -rf "$OWN" && mkdir -p "$OWN"
  "$PY" -m streamer.launch.cli toy-model --arch glm4_moe --hidden 1536 --layers 20 --out "$OWN/model" \
    --stream examples/own-model/stream.jsonl
  "$PY" -m streamer.launch.cli replay examples/own-model/stream.jsonl --speed 0 --limit 128 --model "$OWN/model" \
    --out "$OWN/tasks.jsonl"
  /usr/bin/time -f "agent (vllm): %e s" "$VLLM_PY" -m streamer.launch.cli agent --model "$OWN/model" \
    --tasks "$OWN/tasks.jsonl" --out "$OWN/trajectories.jsonl" --set engine=vllm --set concurrency=128 \
    --set max_new_tokens=16
  /usr/bin/time -f "learner (megatron, $OWN_NPROC GPU(s)): %e s" "$PY" -m streamer.launch.cli learn --backend megatron \
    --nproc "$OWN_NPROC" --init "$OWN/model" --trajectories "$OWN/trajectories.jsonl" --checkpoint-dir "$OWN/ckpt" \
    --set backend.expert_parallel="$OWN_NPROC" --set backend.dtype=bfloat16 --set loss.kl_coef=0 \
    --set batch.max_trajectories=32 --max-steps 4 --set io.events="$OWN/events.jsonl"
  echo "saved $OWN (trajectories.jsonl, events.jsonl)"
fi

# The torch learner on the GPU (learner.device auto): a randomly initialised ~0.5B Qwen2 built from its config (no
# download), one learner update per memory option (LoRA, value head, gradient checkpointing, micro-batches by
# tokens, bf16) with its peak GPU memory and tokens/s, beside docs/results/real_model.json's CPU figures.
if [ "${SKIP_REAL_MODEL:-0}" != 1 ]; then
  "$PY" bench/real_model.py --models qwen2-500m --rows 16 --tokens 512 --steps 3 --timeout 600 \
    --configs baseline,lora,value_head,bf16,grad_ckpt,lora+head+ckpt+micro+bf16 --out runs/bench/gpu_real_model.json
  echo "saved runs/bench/gpu_real_model.json"
fi

# The drift suite's pilot on the machine's CPU cores (the tiny model's harness does not use the GPU); the warm start
# is built first when runs/cache lacks it. Suite 2.1 (issue 49): its tuning search (experiments/suite_tune.py) for SAO
# then GRPO, 9 runs of a setting at once, stopped after PILOT_BUDGET_S (default 480 s); the run files it leaves are
# the pilot's own and a later invocation resumes them. PILOT_V1=1 also runs 1.6's sized pilot (issue 15, item 7).
if [ "${SKIP_PILOT:-0}" != 1 ]; then
  timeout "${PILOT_BUDGET_S:-480}" "$PY" -m experiments.suite_tune --suite experiments/suites/drift_v2.yaml \
    --arms sao,grpo --jobs "$(nproc)" --out runs/bench/gpu_tune || echo "gpu_check: the 2.1 pilot stopped at its budget"
  ls runs/bench/gpu_tune/tuning-*.json 2>/dev/null || echo "gpu_check: no arm finished its search; run files in runs/bench/gpu_tune/runs"
  if [ "${PILOT_V1:-0}" = 1 ]; then
    "$PY" -m experiments.pilot_sizing --suite experiments/suites/drift_v1_6.yaml --budget-s "${PILOT_BUDGET_S:-480}" \
      --out runs/bench/gpu_pilot
    echo "saved runs/bench/gpu_pilot/pilot.json"
  fi
fi

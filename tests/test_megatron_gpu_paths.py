"""bench/megatron_gpu_paths.py: what the megatron backend leaves to a GPU (megatron-core's DistributedOptimizer and
optimizers, the TransformerEngine spec with grouped GEMM, NCCL, MFU). On CPU its loop runs up to the optimizer
(megatron-core's DDP and finalize_model_grads over gloo) and its optimizer-memory arithmetic is held to the
backend's measured AdamW state (docs/results/megatron_step.json); the GPU test runs it whole, and says why it skips
where there is no CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

REPO = Path(__file__).resolve().parents[1]


def _bench(tmp_path: Path, nproc: int, args: list[str]) -> dict:
    from tests.test_megatron_backend import _free_port

    out = tmp_path / "gpu_paths.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "bench/megatron_gpu_paths.py",
           "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "megatron_gpu_paths: PASS" in proc.stdout
    return json.loads(out.read_text())


@pytest.mark.slow  # one 2-rank torchrun, ~8 s on 2 busy cores
def test_cpu_smoke_up_to_the_optimizer_at_ep2(tmp_path):
    r = _bench(tmp_path, 2, ["--ep", "2", "--seq", "16", "--batch", "4", "--steps", "1", "--warmup", "1"])
    assert (r["backend"], r["spec"], r["dp"], r["optimizer_mib_per_rank"]) == (
        "gloo", "local (no transformer_engine)", 2, None)
    assert r["checks"] == {"step_ran": True, "nccl": None, "te_spec_where_installed": None, "optimizer_memory": None}
    # the arithmetic of Adam's state (fp32: two moments, 8 bytes a parameter) against the backend's torch AdamW at
    # the same layout, measured by bench/megatron_step.py --layouts (EP 2: 13.6 MiB a rank)
    rows = json.loads((REPO / "docs" / "results" / "megatron_step.json").read_text())["rows"]
    (row,) = [x for x in rows if (x["processes"], x["ep"], x["tp"], x["pp"], x["shard_optimizer"]) == (2, 2, 1, 1, 0)]
    for expected, measured in zip(r["optimizer_mib_expected_per_rank"], row["optimizer_state_mib_per_rank"]):
        assert abs(expected - measured) < 0.01, (expected, measured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA: megatron-core's DistributedOptimizer accepts only CUDA parameters, its optimizers "
                           "allocate on device='cuda', TransformerEngine and NCCL need a GPU (bench/gpu_check.sh runs "
                           "bench/megatron_gpu_paths.py on the GPUs present)")
def test_distributed_optimizer_and_te_spec_on_the_gpu(tmp_path):
    n = torch.cuda.device_count()
    r = _bench(tmp_path, n, ["--ep", str(n), "--dtype", "bfloat16", "--dist-opt", "--batch", str(2 * n),
                             "--seq", "256", "--steps", "2", "--warmup", "1"])
    assert r["backend"] == "nccl" and (r["mfu"] is None or 0 < r["mfu"] < 1)
    assert all(v is not False for v in r["checks"].values()), r["checks"]

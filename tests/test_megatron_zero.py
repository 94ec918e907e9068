"""The megatron backend's sharded optimizer (ZeRO-1, `zero.ShardedAdamW`) against its replicated AdamW, under torchrun
(2 processes, gloo, CPU): three policy and critic steps bit for bit, and the optimizer state each rank holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.test_megatron_backend import _free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["1", "2"], ids=lambda ep: f"ep{ep}")
def zero(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_zero") / "zero.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "learner.backends.megatron.zero_check", "--out", str(out), "--ep", request.param]
    env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # one 2-rank torchrun per EP, ~20 s each on 2 cores
def test_sharded_adamw_steps_equal_the_replicated_ones_bit_for_bit(zero):
    assert zero["dp"] == 2
    # AdamW is elementwise: each rank stepping its slice and all-gathering gives the same bits
    assert zero["max_abs_per_step"] == [0.0, 0.0, 0.0]
    assert all(m > 5e-4 for m in zero["moved_per_step"])  # the later steps did move (lr 1e-3)


@pytest.mark.slow  # the `zero` fixture
def test_each_rank_holds_its_share_of_the_moments(zero):
    rep, sh = zero["replicated"], zero["sharded"]
    params = rep["param_bytes"][0]
    # replicated: exp_avg + exp_avg_sq of every weight (fp32), plus a 4-byte step counter per tensor
    assert 2 * params <= rep["optimizer_state_bytes"][0] <= 2 * params + 4 * 1000
    if zero["ep"] == 1:  # every weight replicated over the 2 data-parallel ranks: half the moments each
        # 2 moments x 4 bytes x ceil(n_b / 2) per bucket b = params + 4 per odd-sized bucket (one here), plus one
        # 4-byte step counter per bucket (policy and critic, dense and experts: 4)
        assert sh["optimizer_state_bytes"] == [params + 4 + 16] * 2
    else:  # EP 2 on 2 ranks: experts are not replicated (expert-DP 1), only the dense weights are sharded
        assert rep["optimizer_state_bytes"][0] > sh["optimizer_state_bytes"][0] > params

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


# (processes, layout): (EP 1, DP 2), (EP 2, DP 2, expert-DP 1), (TP 2, DP 2, whole experts over expert-DP 4)
LAYOUTS = {"ep1": (2, ["--ep", "1"]), "ep2": (2, ["--ep", "2"]), "tp2": (4, ["--tp", "2"])}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def zero(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_zero") / "zero.json"
    nproc, flags = LAYOUTS[request.param]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "learner.backends.megatron.zero_check", "--out", str(out), *flags]
    env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # one torchrun per layout, 17-30 s each on 2 cores
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
    if zero["tp"] == 2:  # dense slices over DP 2, whole experts over expert-DP 4: measured 0.258
        assert sh["optimizer_state_bytes"][0] <= 0.3 * rep["optimizer_state_bytes"][0]
    elif zero["ep"] == 1:  # every weight replicated over the 2 data-parallel ranks: half the moments each
        # 2 moments x 4 bytes x ceil(n_b / 2) per bucket b = params + 4 per odd-sized bucket (one here), plus one
        # 4-byte step counter per bucket (policy and critic, dense and experts: 4)
        assert sh["optimizer_state_bytes"] == [params + 4 + 16] * 2
    else:  # EP 2 on 2 ranks: experts are not replicated (expert-DP 1), only the dense weights are sharded
        assert rep["optimizer_state_bytes"][0] > sh["optimizer_state_bytes"][0] > params


# ---------------------------------------------------------------------- sao learn with backend.shard_optimizer

from tests.test_megatron_learn import TRAIN, _max_abs, _policy, torch_run, traj_file  # noqa: E402, F401


def _learn_sharded(traj: Path, root: Path, max_steps: int) -> None:
    from streamer.wire.config import set_args

    cmd = [sys.executable, "-m", "streamer.launch.cli", "learn", "--backend", "megatron", "--nproc", "2",
           "--set", "backend.shard_optimizer=true", "--trajectories", str(traj), "--checkpoint-dir", str(root / "ck"),
           "--weights-dir", str(root / "w"), "--max-steps", str(max_steps), *set_args(TRAIN)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow  # two 2-rank torchruns of sao learn (~25 s each) and tests/test_megatron_learn.py's torch run
def test_sao_learn_with_sharded_optimizer_resumes_and_matches_torch(traj_file, torch_run, tmp_path):  # noqa: F811
    """(EP 1, DP 2), the AdamW moments split over the two ranks: a first launch stops after step 1, a second resumes
    from the moments saved layout-free (each rank cutting its slice back out) and trains steps 2 and 3 as the
    uninterrupted torch run does."""
    from safetensors.torch import load_file

    from streamer.transport.weights import WeightStore

    _learn_sharded(traj_file, tmp_path, max_steps=1)
    ck = tmp_path / "ck" / "step_00000001"
    layout = json.loads((ck / "state.json").read_text())["layout"]
    assert layout == {"backend": "megatron", "world_size": 2, "expert_parallel": 1, "shard_optimizer": True}
    # the slices gathered into rank 0's whole moments (EP 1: rank 0 writes every tensor; any layout resumes them:
    # tests/test_megatron_reshard.py)
    moments = load_file(str(ck / "policy.exp_avg_sq.00001-of-00001.safetensors"))
    weights = load_file(str(ck / "policy.weights.00001-of-00001.safetensors"))
    assert all(float(t.abs().max()) > 0 for t in moments.values())  # both ranks' slices
    assert sum(t.numel() for t in moments.values()) == sum(t.numel() for t in weights.values())
    _learn_sharded(traj_file, tmp_path, max_steps=3)
    store = WeightStore(tmp_path / "w")
    assert [pv.version for pv in store.versions()] == [0, 1, 2, 3]
    for v in (1, 2, 3):  # a restarted Adam, or the wrong rank's moments, would move the weights by ~lr
        assert _max_abs(_policy(store, v), _policy(torch_run["store"], v)) <= 1e-6

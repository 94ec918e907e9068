"""Megatron checkpoints that reshard: `sao learn --backend megatron` saves at one layout, stops, resumes at another
(other ranks, TP, PP, EP, sharded optimizer or not) and trains on as the uninterrupted torch run does: the same
losses, the same source positions, the same weights, and the same exactly-once state (positions, buffer, dedupe
window, lineage, offsets) in its checkpoints. The AdamW moments travel in HF naming (reshard.py), so a restarted
Adam (or the wrong slice of the moments) would move the weights by ~lr and fail the 1e-6 bounds on each update."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from learner.trainer.checkpoint import check_layout  # noqa: E402
from streamer.transport.weights import WeightStore  # noqa: E402
from tests.test_megatron_learn import (  # noqa: E402, F401
    LR,
    TRAIN,
    _max_abs,
    _policy,
    megatron_learn,
    torch_reference,
    torch_run,
    traj_file,
)

REPO = Path(__file__).resolve().parents[1]
KV2 = ["model.num_kv_heads=2"]  # TP 2 splits whole KV groups


def _learn(traj: Path, root: Path, max_steps: int, nproc: int, layout: list[str], extra: list[str] = ()) -> None:
    proc = megatron_learn(root, traj, [*TRAIN, *extra, *layout], max_steps, nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _events(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "ck" / "events.jsonl").read_text().splitlines()]


def _exactly_once_of(ck: Path) -> dict:
    """A checkpoint's exactly-once state, as tests.test_megatron_learn.exactly_once gives the torch trainer's."""
    s = json.loads((ck / "state.json").read_text())
    pending = [json.loads(line)["traj_id"] for line in (ck / "pending.jsonl").read_text().splitlines()]
    return {**{k: s[k] for k in ("positions", "admission", "counters", "offsets")}, "pending": pending}


def _saved_mid_buffer(root: Path, traj: Path, ref: dict) -> None:
    """The step-1 checkpoint, written at the first layout, holds the torch run's exactly-once state after step 1: the
    file read to its end, 14 trajectories buffered with their offsets, all 21 in the dedupe window; so the resumed
    run's steps 2 and 3 can only train on the buffer the checkpoint carried."""
    saved = _exactly_once_of(root / "ck" / "step_00000001")
    assert saved == ref["exactly_once"][0]
    assert saved["positions"] == {"file": traj.stat().st_size} and len(saved["pending"]) == len(saved["offsets"]) == 14
    assert len(saved["admission"]["seen"]) == 21


def _continues_as(root: Path, ref: dict, steps: tuple[int, ...], weights_tol: float = 1e-6) -> None:
    """Steps `steps` of the resumed run read the same trajectories and give the torch run's losses, weight updates and
    weights (within `weights_tol`); its last checkpoint holds the torch run's exactly-once state."""
    events = {e["step"]: e for e in _events(root)}
    store = WeightStore(root / "w")
    for s in steps:
        e, t = events[s], ref["events"][s - 1]
        assert e["task_ids"] == [tr for tr in t.task_ids], s  # the same source positions
        for k in ("policy_loss", "value_loss", "grad_norm"):
            m_k, t_k = e["metrics"][f"learner/{k}"], t.metrics[f"learner/{k}"]
            assert abs(m_k - t_k) <= 1e-6 * max(1.0, abs(t_k)), (s, k, m_k, t_k)
        mine, theirs = _policy(store, s), _policy(ref["store"], s)
        before, theirs_before = _policy(store, s - 1), _policy(ref["store"], s - 1)
        # each step's update as the torch run's: a restarted Adam moves the weights by ~lr (3e-4) more (measured
        # within 1e-7 here); the weights themselves carry whatever step 1 left at the first layout
        assert _max_abs({k: mine[k] - before[k] for k in mine}, {k: theirs[k] - theirs_before[k] for k in mine}) <= 1e-6
        assert _max_abs(mine, theirs) <= weights_tol, s
    assert _exactly_once_of(root / "ck" / f"step_{steps[-1]:08d}") == ref["exactly_once"][steps[-1] - 1]


def _reshards(traj: Path, root: Path, ref: dict, source: tuple[int, list[str]], target: tuple[int, list[str]],
              extra: list[str] = (), weights_tol: float = 1e-6, saved=lambda ck: None) -> None:
    """Step 1 at `source` (ranks, settings), its checkpoint checked (and handed to `saved`); steps 2-3 resumed at
    `target` from it, checked against the torch run `ref`."""
    _learn(traj, root, 1, source[0], source[1], extra)
    _saved_mid_buffer(root, traj, ref)
    saved(root / "ck" / "step_00000001")
    _learn(traj, root, 3, target[0], target[1], extra)
    _continues_as(root, ref, (2, 3), weights_tol)


def _by_shard_ep2(ck: Path) -> None:
    """Written by shard: each EP rank its own experts (and rank 0 the dense tensors) of the weights and each moment."""
    assert {p.name for p in ck.glob("policy.*")} == {
        f"policy.{k}.{i:05d}-of-00002.safetensors" for k in ("weights", "exp_avg", "exp_avg_sq") for i in (1, 2)}
    assert not list(ck.glob("optim_*.safetensors")) and not (ck / "policy.safetensors").exists()
    files = {k: [load_file(str(f)) for f in sorted(ck.glob(f"policy.{k}.*"))] for k in ("weights", "exp_avg")}
    experts = [{n for n in part if ".mlp.experts." in n} for part in files["weights"]]
    assert experts[0] and experts[1] and not experts[0] & experts[1]  # each rank its own experts, whole
    weights = {n: t for part in files["weights"] for n, t in part.items()}
    moments = {n: t for part in files["exp_avg"] for n, t in part.items()}
    assert set(moments) == set(weights) and "lm_head.weight" not in weights  # HF names; tied: the embedding alone
    assert all(moments[k].shape == weights[k].shape for k in weights)


@pytest.mark.slow  # a 2-rank and a 1-rank sao learn (~25 s each) and tests/test_megatron_learn.py's torch run
def test_ep2_checkpoint_resumes_on_one_rank(traj_file, torch_run, tmp_path):  # noqa: F811
    """Saved at (EP 2) on 2 ranks after step 1; resumed at (TP 1, EP 1) on 1 rank for steps 2 and 3."""
    _reshards(traj_file, tmp_path, torch_run, (2, ["backend.expert_parallel=2"]), (1, ["backend.expert_parallel=1"]),
              saved=_by_shard_ep2)
    state = json.loads((tmp_path / "ck" / "step_00000003" / "state.json").read_text())
    assert state["layout"] == {"backend": "megatron", "world_size": 1, "expert_parallel": 1}


@pytest.fixture(scope="module")
def torch_kv2(traj_file, tmp_path_factory) -> dict:  # noqa: F811
    """3 torch steps on the model TP 2 needs (2 KV heads)."""
    return torch_reference(traj_file, tmp_path_factory.mktemp("torch_kv2"), TRAIN + KV2, 3)


@pytest.mark.slow  # two 2-rank sao learn runs (~25 s each) and a 3-step torch run
def test_tp2_checkpoint_resumes_at_ep2_with_sharded_optimizer(traj_file, torch_kv2, tmp_path):  # noqa: F811
    """Saved at (TP 2) after step 1; resumed at (EP 2, DP 2) with the AdamW moments sharded over the 2 ranks."""
    _reshards(traj_file, tmp_path, torch_kv2, (2, ["backend.tensor_parallel=2"]),
              (2, ["backend.expert_parallel=2", "backend.shard_optimizer=true"]), KV2)


@pytest.mark.slow  # two 2-rank sao learn runs (~30 s each) and a 3-step torch run
def test_pp2_checkpoint_resumes_at_tp2(traj_file, tmp_path):  # noqa: F811
    """Saved at (PP 2) after step 1 (each stage one layer); resumed at (TP 2) for steps 2 and 3."""
    model = KV2 + ["model.num_layers=2"]
    ref = torch_reference(traj_file, tmp_path / "torch", TRAIN + model, 3)
    _reshards(traj_file, tmp_path, ref, (2, ["backend.pipeline_parallel=2"]), (2, ["backend.tensor_parallel=2"]), model)


@pytest.mark.slow  # two 2-rank sao learn runs (~20 s each) and a 3-step torch run (~9 s)
def test_glm4_moe_pp2_checkpoint_resumes_at_tp2_ep2(traj_file, tmp_path):  # noqa: F811
    """The tiny GLM-4-MoE (a dense first layer, shared experts, qkv bias, untied head, a sigmoid router whose
    selection bias is a buffer no step changes, non-zero here) saved at (PP 2: layers 0-1 | 2) after step 1, resumed
    at (TP 2, EP 2) for steps 2 and 3. Its weights stay up to 0.1 * lr from the torch run's (H7's AdamW bound),
    measured 1.2e-5 after step 1 at PP 2 already (a layer-2 k_proj entry: Adam's g/|g| on a tiny gradient) and
    unchanged by steps 2-3, whose updates match within 1e-6."""
    from learner.models.tokenizer import CharTokenizer
    from tests.test_megatron_backend import tiny_glm4_moe

    model = tmp_path / "glm4_moe"
    tiny_glm4_moe(seed=0).save_pretrained(model)
    CharTokenizer().save(model)  # sao learn publishes the init's tokenizer with each version
    init = [f"io.init={model}"]  # the trajectories' tokens (8-40) are in its vocabulary (96)
    ref = torch_reference(traj_file, tmp_path / "torch", TRAIN + init, 3)
    _reshards(traj_file, tmp_path, ref, (2, ["backend.pipeline_parallel=2"]),
              (2, ["backend.tensor_parallel=2", "backend.expert_parallel=2"]), init, weights_tol=0.1 * LR)
    bias = {k: t for k, t in load_file(str(model / "model.safetensors")).items() if k.endswith("correction_bias")}
    assert len(bias) == 2 and all(t.abs().max() > 0.1 for t in bias.values())  # layers 1 and 2
    for v in (1, 2, 3):  # the router bias saved by the stages and read back at TP 2, EP 2, as it was
        pol = _policy(WeightStore(tmp_path / "w"), v)
        assert all(torch.equal(pol[k], t) for k, t in bias.items()), v


def test_layouts_that_cannot_reshard_are_refused_naming_both(tmp_path):
    ep2 = {"backend": "megatron", "world_size": 2, "expert_parallel": 2}
    (tmp_path / "state.json").write_text(json.dumps({"layout": ep2}))
    one = {"backend": "megatron", "world_size": 1, "expert_parallel": 1}
    with pytest.raises(ValueError, match=r"written by \{.*'world_size': 2.*this learner is \{.*'world_size': 1.*"
                                         "tied to that layout"):
        check_layout(tmp_path, one)  # optimizer state saved per rank
    check_layout(tmp_path, one, reshards=True)  # layout-free optimizer state: any megatron layout
    with pytest.raises(ValueError, match="this learner is .*'torch'.*another backend's"):
        check_layout(tmp_path, {"backend": "torch", "world_size": 1, "expert_parallel": 1}, reshards=True)


# ---------------------------------------------------------------------- the learner API, pipeline stages included

@pytest.mark.slow  # one 2-rank torchrun each, ~20 s
@pytest.mark.parametrize("source,target", [("pp=2", "tp=2"), ("tp=2", "pp=2")])
def test_moments_saved_at_one_layout_step_on_at_another(source, target, tmp_path):
    """learner/backends/megatron/reshard_check.py: a policy and critic step at `source`, weights and moments saved,
    a second step there; a learner at `target` from the saved weights and moments takes the same second step."""
    from tests.test_megatron_backend import _free_port

    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "-m",
           "learner.backends.megatron.reshard_check", "--out", str(out), "--dir", str(tmp_path),
           "--source", source, "--target", target]
    env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    # measured 6.9e-7 / 3.1e-7 (PP 2 -> TP 2): the two layouts' fp32 reductions; lr is 1e-3 and a restarted AdamW
    # is off by 1.7e-3
    assert max(r["max_abs_resumed"].values()) <= 1e-5
    assert min(r["max_abs_adam_restarted"].values()) >= 1e-4

"""`sao learn` at pipeline parallelism 2: the trainer's own step code (prepare, update) on the megatron backend, its
backward passes through megatron-core's 1F1B schedule (learner.backends.megatron.pipeline_step), against the torch
backend on the same trajectories; and the micro-batch rows it cuts, by hand."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from learner.backends.megatron.pipeline_step import padded_rows  # noqa: E402
from tests.test_megatron_learn import TRAIN, _max_abs, _policy, megatron_learn, torch_reference, traj_file  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[1]
PP_TRAIN = TRAIN + ["model.num_layers=2"]  # one layer a stage


def test_micro_batch_rows_by_hand():
    n, idx = padded_rows(7, 2)  # 7 rows, at most 2 a micro-batch: 4 micro-batches of 2, row 0 again at the end
    assert n == 4 and idx.tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    n, idx = padded_rows(7, 3)  # 3 micro-batches of 3: two copies of row 0
    assert n == 3 and idx.tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0]
    n, idx = padded_rows(4, 8)
    assert n == 1 and idx.tolist() == [0, 1, 2, 3]


def _learn(root: Path, traj: Path, sets: list[str], steps: int = 2) -> subprocess.CompletedProcess:
    return megatron_learn(root, traj, sets, steps)


@pytest.fixture(scope="module")
def pp_run(traj_file, tmp_path_factory) -> Path:  # noqa: F811
    """`sao learn --backend megatron --nproc 2` at PP 2 (two stages of one replica): 2 steps."""
    root = tmp_path_factory.mktemp("megatron_pp_learn")
    proc = _learn(root, traj_file, PP_TRAIN + ["backend.name=megatron", "backend.pipeline_parallel=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def torch_pp_ref(traj_file, tmp_path_factory) -> dict:  # noqa: F811
    """The torch backend on the same file and model, 3 steps."""
    return torch_reference(traj_file, tmp_path_factory.mktemp("torch_pp_ref"), PP_TRAIN, 3)


@pytest.mark.slow  # a 2-rank torchrun of sao learn (~30 s) and a 2-step torch run
def test_sao_learn_at_pp2_matches_the_torch_backend(pp_run, torch_pp_ref):
    from streamer.transport.weights import WeightStore

    events = [json.loads(line) for line in (pp_run / "ck" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["n_trajectories"]) for e in events] == [(1, 7), (2, 7)]
    for e, t in zip(events, torch_pp_ref["events"]):  # the last stage's metrics, sent to the first: not doubled
        for k in ("grad_norm", "value_grad_norm", "policy_loss", "value_loss", "entropy", "n_tokens", "clip_frac"):
            m_k, t_k = e["metrics"][f"learner/{k}"], t.metrics[f"learner/{k}"]
            assert abs(m_k - t_k) <= 1e-5 * max(1.0, abs(t_k)), k
    store, ref = WeightStore(pp_run / "w"), torch_pp_ref["store"]
    assert [pv.version for pv in store.versions()][:3] == [0, 1, 2]
    assert _max_abs(_policy(store, 0), _policy(ref, 0)) == 0.0  # HF -> stages -> HF lossless
    for v in (1, 2):  # published by shard (each stage its own layers); AdamW steps as the torch run's
        assert _max_abs(_policy(store, v), _policy(ref, v)) <= 1e-6
    vdir = store.resolve([pv for pv in store.versions() if pv.version == 2][0])
    assert len(list(vdir.glob("model-*-of-00002.safetensors"))) == 2
    state = json.loads((pp_run / "ck" / "step_00000002" / "state.json").read_text())
    assert state["layout"] == {"backend": "megatron", "world_size": 2, "expert_parallel": 1, "pipeline_parallel": 2}


@pytest.mark.slow  # one more 2-rank torchrun: the checkpoint at PP 2 resumed at PP 2 for a third step
def test_sao_learn_at_pp2_resumes_from_its_checkpoint(pp_run, torch_pp_ref, traj_file):  # noqa: F811
    from streamer.transport.weights import WeightStore

    proc = _learn(pp_run, traj_file, PP_TRAIN + ["backend.name=megatron", "backend.pipeline_parallel=2"], steps=3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in (pp_run / "ck" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["n_trajectories"]) for e in events] == [(1, 7), (2, 7), (3, 7)]
    m, t = events[2]["metrics"], torch_pp_ref["events"][2].metrics  # the next batch, weights and AdamW moments
    for k in ("grad_norm", "value_grad_norm", "policy_loss", "value_loss"):
        assert abs(m[f"learner/{k}"] - t[f"learner/{k}"]) <= 1e-5 * max(1.0, abs(t[f"learner/{k}"])), k
    assert _max_abs(_policy(WeightStore(pp_run / "w"), 3), _policy(torch_pp_ref["store"], 3)) <= 1e-6


@pytest.mark.slow  # a 2-rank torchrun of one step and a 1-step torch run
def test_decoupled_ppo_at_pp2_scores_its_proximal_policy_through_the_schedule(traj_file, tmp_path):  # noqa: F811
    """decoupled_ppo's proximal log-probs come from `prepare`'s policy forward without a graph: at PP 2 the HF-call
    wrapper runs it through the schedule (the logits sent from the last stage) and the step matches the torch one."""
    from streamer.transport.weights import WeightStore

    sets = PP_TRAIN + ["loss.name=decoupled_ppo"]
    proc = _learn(tmp_path / "m", traj_file, sets + ["backend.name=megatron", "backend.pipeline_parallel=2"], steps=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = torch_reference(traj_file, tmp_path / "torch", sets, 1)
    [e] = [json.loads(line) for line in (tmp_path / "m" / "ck" / "events.jsonl").read_text().splitlines()]
    t = ref["events"][0].metrics
    for k in ("policy_loss", "grad_norm", "entropy"):
        assert abs(e["metrics"][f"learner/{k}"] - t[f"learner/{k}"]) <= 1e-5 * max(1.0, abs(t[f"learner/{k}"])), k
    assert _max_abs(_policy(WeightStore(tmp_path / "m" / "w"), 1), _policy(ref["store"], 1)) <= 1e-6

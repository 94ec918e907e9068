"""Every arm starts each drift from one common pre-drift checkpoint (experiments/common_start.py, issue 49 item 4),
on the real engine and learner with the tiny random policy."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from experiments.common_start import post_drift_stream, pre_drift_tasks
from experiments.harness import Harness, SimConfig, save_start
from experiments.suite import main as suite_main
from experiments.suite_config import load_plan
from experiments.suite_runs import drift_stream
from learner.models.policy import load_policy
from streamer.wire.schema import DriftEvent, Task

SUITE_1_5 = Path(__file__).resolve().parent.parent / "experiments" / "suites" / "drift_v1_5.yaml"


def test_a_drift_stream_splits_into_its_pre_drift_tasks_and_the_rest_from_the_drift():
    plan = load_plan(SUITE_1_5, quick=True)
    stream = drift_stream(plan, plan.drifts[0], 0, 1)[0]
    pre, post = pre_drift_tasks(stream), post_drift_stream(stream)
    assert len(pre) == plan.pre and {t.phase for t in pre} == {0}
    assert isinstance(post[0], DriftEvent) and {m.phase for m in post[1:]} == {1}
    assert [m.seq for m in pre + post[1:]] == [m.seq for m in stream if isinstance(m, Task)]


def test_a_start_gives_its_critic_to_a_critic_of_its_shape_and_its_policy_blocks_to_another(tiny_policy_dir, tmp_path):
    sim = SimConfig(batch=8, threads=1)
    saved = Harness(sim, str(tiny_policy_dir), ["value.layers=1"])
    for p in (*saved.models.policy.parameters(), *saved.models.value.parameters()):
        p.data.add_(0.01)  # the start differs from the warm start everywhere
    save_start(saved.models, tmp_path)
    same = Harness(sim, str(tiny_policy_dir), ["value.layers=1"], start_from=str(tmp_path))
    assert same.trainer.warm_left == 0  # the start's critic has trained: no cold-start warm-up
    assert all(torch.equal(a, b) for a, b in zip(same.models.value.state_dict().values(),
                                                  saved.models.value.state_dict().values()))
    head = Harness(sim, str(tiny_policy_dir), ["value.kind=head"], start_from=str(tmp_path))
    assert head.trainer.warm_left == head.cfg.value.warmup_steps > 0  # another critic: a fresh head warms up
    policy = same.models.policy.state_dict()
    assert all(torch.equal(policy[k], v) for k, v in saved.models.policy.state_dict().items())


def test_every_arm_starts_the_drift_from_the_reference_arms_pre_drift_checkpoint(tiny_policy_dir, tmp_path):
    (tmp_path / "common.yaml").write_text(f"extends: {SUITE_1_5}\nversion: test\ncommon_start: sao\n"
                                          "quick: {arms: [sao, eta0, grpo, frozen], drifts: [tool_rename]}\n")
    # the quick pre-drift phase is 4 steps: 1 of critic warm-up leaves 3 that move the policy
    args = ["--suite", str(tmp_path / "common.yaml"), "--init", str(tiny_policy_dir), "--quick", "--set",
            "value.layers=1", "--set", "value.warmup_steps=1", "--out", str(tmp_path / "out")]
    assert suite_main(args) == 0
    start = tmp_path / "out" / "common_start" / "tool.look_plain_0-s0"
    meta = json.loads((start / "start.json").read_text())
    assert meta["learner_steps"] > 0 and meta["settings"]["arm"] == "sao"  # SAO trained on the pre-drift phase
    trained, warm = load_file(start / "policy.safetensors"), load_policy(str(tiny_policy_dir)).state_dict()
    assert any(not (trained[k] == warm[k]).all() for k in trained)  # the checkpoint is not the warm start
    runs = {arm: json.loads((tmp_path / "out" / "runs" / f"tool_rename-{arm}-s0.json").read_text())
            for arm in ("sao", "eta0", "grpo", "frozen")}
    for run in runs.values():
        assert run["common_start"] == {k: v for k, v in meta.items() if k != "settings"}
        assert [p["phase"] for p in run["by_phase"]] == [1]  # the post-drift phase alone
        assert len(run["post_drift"]["reward"]) == 256
    assert runs["sao"]["steps"][0]["learner/value_warmup"] == 0  # SAO's first step already moves the policy
    # one policy, one task sequence, the same rollout seeds: before the first step the single-rollout arms generate
    # the same answers, whatever they do after
    first = {arm: runs[arm]["post_drift"]["n_gen"][:32] for arm in ("sao", "eta0", "frozen")}
    assert first["sao"] == first["eta0"] == first["frozen"]
    assert runs["frozen"]["summary"]["learner_steps"] == 0 < runs["eta0"]["summary"]["learner_steps"]
    stamp = (start / "start.json").stat().st_mtime_ns
    assert suite_main(args) == 0 and (start / "start.json").stat().st_mtime_ns == stamp  # reused, not retrained

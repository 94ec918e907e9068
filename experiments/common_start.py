"""Adaptation measured from the drift (issue 49, item 4): every arm starts each drift from one common checkpoint.

The reference arm (SAO) trains once on a drift's pre-drift phase for each (pre-drift concept, seed); its policy and
critic are saved (`save_start`). Every arm, the controls included, then runs the post-drift phase alone from that
checkpoint with fresh optimizers, the warm start staying its KL reference: η = 0 and the group methods start from a
policy that pre-drift RL has trained, as SAO does, and differences after the drift are differences in adapting.
An arm with a critic takes the checkpoint's, which has seen the pre-drift phase (so the critic's depth is the suite's,
not an arm's): its first steps skip the warm-up meant for a fresh head (the harness's `load_start`); the re-warm-up
after a value-loss spike stays. The reference arm runs at its tuned setting (`Plan.reference`), in every file of the
suite alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.arms import Arm, arm
from experiments.common import init_sha256, reusable_run
from experiments.harness import Harness
from experiments.harness.loop import save_start
from streamer.wire.schema import DriftEvent, Task


def pre_drift_tasks(stream: list[Task | DriftEvent]) -> list[Task]:
    """The stream's pre-drift tasks (phase 0), no drift event."""
    return [m for m in stream if isinstance(m, Task) and m.phase == 0]


def post_drift_stream(stream: list[Task | DriftEvent]) -> list[Task | DriftEvent]:
    """The stream from its drift on: the drift events and every task of a later phase, in order."""
    return [m for m in stream if isinstance(m, DriftEvent) or m.phase > 0]


def start_dir(out_dir: Path, key: str, seed: int) -> Path:
    return Path(out_dir) / "common_start" / f"{key.replace('/', '_')}-s{seed}"


def start_settings(reference: Arm, pre: int, key: str, seed: int, sim: dict, learner_sets: list[str],
                   init: str) -> dict[str, Any]:
    return {"arm": reference.name, "pre_key": key, "seed": seed, "pre": pre, "sim": sim,
            "learner_sets": list(learner_sets), "init": init, "init_sha256": init_sha256(init)}


def finished_start(path: Path, settings: dict[str, Any]) -> dict | None:
    """`path`'s start.json when it holds a checkpoint trained with exactly these settings, else None."""
    if not (path / "policy.safetensors").is_file():
        return None
    return reusable_run(path / "start.json", {"settings": json.loads(json.dumps(settings))})


def train_common_start(path: Path, settings: dict[str, Any], sim, stream: list[Task | DriftEvent],
                       scenario_rate: float, log=print) -> dict[str, Any]:
    """The reference arm's run on the stream's pre-drift tasks, its models saved to `path` with what it did."""
    if (done := finished_start(path, settings)) is not None:
        return done
    tasks = pre_drift_tasks(stream)
    log(f"[common start] {settings['pre_key']} seed {settings['seed']}: {settings['arm']} on {len(tasks)} "
        "pre-drift tasks")
    harness = Harness(sim, settings["init"], settings["learner_sets"])
    res = harness.run(tasks, scenario_rate, log)
    save_start(harness.models, path)
    meta = {"settings": settings, "learner_steps": int(len(res.steps)), "version": harness.trainer.version,
            "pre_reward": float(res.trajectories["reward"].mean()), "cpu_s": round(res.cpu_s, 2),
            "wall_s": round(res.wall_s, 2)}
    (path / "start.json").write_text(json.dumps(meta, indent=1))
    return meta


def reference_arm(name: str) -> Arm:
    """The arm whose pre-drift run is every arm's start: trained, single rollout (its tasks are every arm's)."""
    ref = arm(name)
    if ref.group_size != 1 or not ref.sim.get("train", True):
        raise ValueError(f"common start from arm {name}: it must train single rollouts (group size "
                         f"{ref.group_size}, train {ref.sim.get('train', True)})")
    return ref

"""A simulated online-learning harness: the real engine, environments, verifiers and learner step in one process,
with simulated asynchrony (issue 15, item 1).

Time is a simulated clock, never the wall clock. Tasks come from a scenario stream, at `SimConfig.rate` per
simulated second (0: as fast as admission allows) with at most `max_in_flight` rollouts in flight (a group of n
counts n). Admission happens at ticks of `tick_s`: every task admitted at a tick starts then, with the policy
version the rollouts see at that moment, and all of them are generated in one engine batch (`run_tasks`). A rollout
finishes at start + generated tokens / `gen_tokens_per_s` + the simulated latency of each of its tool calls
(`simulator.latency`, long-tailed, sampled by the environment and not slept). A single rollout joins the learner's
buffer when it finishes; a GRPO-family group joins when its last member finishes, as one unit, and goes stale as a
unit (the learner's `Admission`, `Batcher` and `split_stale`). The learner (`Trainer.train_on`, the real step)
trains as soon as `batch` trajectories are buffered, dropping those more than `eta` versions behind it; each step
publishes a version into a ring of recent snapshots (`SnapshotRing`, the learner's `Publisher`), which rollouts
started after `learner_step_s` simulated seconds use.

Generation is done eagerly at a rollout's start, so the finish time is known when it is scheduled; the ring is what
lets the rollout policy lag the learner (learner_step_s > 0) and what a lazier generation would read.

Everything is seeded: the same seed gives the same trajectories, rewards and learner steps (tests/test_harness.py).
`simulate_branches` runs several streams that start with the same tasks (drifts from one concept) as one run up to
the first admission of a task of their own, then one deep copy of it per stream: each branch's Result is the one
`simulate` gives on that stream alone (tested), the shared part's cost split between them.

The package: `config` (SimConfig, MODES), `clock` (arrival and finish times, the event order), `streams` (a
scenario's task stream, phase prefixes, shared tasks), `admission` (the snapshot ring, starting rollouts and their
joins), `loop` (Harness, the event loop and the learner, simulate, simulate_branches), `report` (summaries).

    .venv/bin/python -m experiments.harness --init runs/cache/warmstart-XXXX --scenario default --limit 2000
"""

from __future__ import annotations

from experiments.harness.admission import SnapshotRing
from experiments.harness.clock import arrival_times, finish_time
from experiments.harness.config import MODES, UNBOUNDED_TOKENS, SimConfig, default_latency
from experiments.harness.loop import Harness, Result, load_start, save_start, simulate, simulate_branches
from experiments.harness.report import by_phase, summary
from experiments.harness.streams import phase_prefix, scenario_stream, shared_tasks

__all__ = ["MODES", "UNBOUNDED_TOKENS", "Harness", "Result", "SimConfig", "SnapshotRing", "arrival_times", "by_phase",
           "default_latency", "finish_time", "load_start", "phase_prefix", "save_start", "scenario_stream",
           "shared_tasks", "simulate", "simulate_branches", "summary"]

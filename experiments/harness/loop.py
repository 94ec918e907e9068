"""The run loop: `Harness` processes the simulated events (admission ticks, joins, publications) and runs the
learner's step; `simulate` runs one stream, `simulate_branches` several that start with the same tasks."""

from __future__ import annotations

import copy
import heapq
import itertools
import random
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from experiments.harness.admission import RolloutAdmission, SnapshotRing
from experiments.harness.clock import ORDER, Event, arrival_times
from experiments.harness.config import UNBOUNDED_TOKENS, SimConfig
from experiments.harness.streams import shared_tasks
from learner.algorithms import NEEDS_GROUPS
from learner.config import LearnerConfig
from learner.engines import make_engine
from learner.models import CharTokenizer
from learner.train import build_models
from learner.trainer.loop import Trainer
from learner.trainer.staleness import staleness
from streamer.runs.recovery import drift_recoveries
from streamer.wire.config import load_config
from streamer.wire.schema import DriftEvent, Task, Trajectory
from streamer.wire.settings import AgentSettings


@dataclass
class Result:
    trajectories: pd.DataFrame  # one row per trajectory
    steps: pd.DataFrame  # one row per learner step
    drifts: list[dict]
    recoveries: pd.DataFrame
    wall_s: float
    sim_s: float
    counts: dict[str, int]
    cpu_s: float = 0.0  # this process's CPU seconds (all threads)
    sections: dict[str, dict[str, float]] = field(default_factory=dict)  # where the time went: wall and CPU s

    @property
    def per_wall_s(self) -> float:
        return len(self.trajectories) / max(self.wall_s, 1e-9)

    def per_cpu_s(self, threads: int) -> float:
        """Trajectories per second had the process had its `threads` cores to itself (the machine is shared)."""
        return len(self.trajectories) / max(self.cpu_s / threads, 1e-9)


class Harness(RolloutAdmission):
    """One simulated run: the learner, the engine and the event queue (admission: `RolloutAdmission`)."""

    def __init__(self, sim: SimConfig, init: str, learner_sets: list[str] = (), agent_sets: list[str] = (),
                 start_from: str | None = None) -> None:
        """`start_from`: a directory of `save_start`'s, whose policy (and critic, when this arm has one of its shape)
        replace the models built from `init` before the first version; `init` stays the KL reference."""
        sim.validate()
        self.sim = sim
        torch.set_num_threads(sim.threads)
        sets = [f"io.init={init}", f"seed={sim.seed}", f"threads={sim.threads}", f"batch.max_staleness={sim.eta}",
                f"batch.max_trajectories={sim.batch}", f"batch.tokens={UNBOUNDED_TOKENS}", *learner_sets]
        if sim.group_size > 1:
            sets.append(f"advantage.group_size={sim.group_size}")
        self.cfg = load_config(LearnerConfig, None, sets)
        if self.cfg.advantage.estimator in NEEDS_GROUPS and sim.group_size < 2:  # gae, reinforce_pp: any group_size
            raise ValueError(f"estimator {self.cfg.advantage.estimator} with group_size {sim.group_size}: a group "
                             "estimator needs groups (group_size > 1)")
        self.agent = load_config(AgentSettings, None, [f"seed={sim.seed}", f"group_size={sim.group_size}",
                                                       *agent_sets])
        self.models = build_models(self.cfg)
        critic_trained = load_start(self.models, start_from) if start_from else False
        self.ring = SnapshotRing(sim.ring)
        self.trainer = Trainer(self.cfg, self.models, source=None, publisher=self.ring)
        if critic_trained:
            self.trainer.warm_left = 0  # the start's critic has trained: no warm-up meant for a fresh head
        self.trainer.start()  # publishes version 0 into the ring
        self.tok = CharTokenizer()
        self.engine = make_engine("torch", copy.deepcopy(self.models.policy), self.tok)
        self.rollout_version = 0  # the newest version rollouts may start with
        self.busy_until = 0.0
        self.events: list[Event] = []
        self._n_events = 0
        self.rows: list[dict] = []
        self.steps: list[dict] = []
        self.row_of: dict[str, int] = {}  # traj_id -> index into rows
        self.running: set[str] = set()  # traj_ids in flight
        self.dropped: set[str] = set()  # stragglers dropped by sync_overprovision (their joins are ignored)
        self.started_tasks = 0
        self.arrivals: deque[tuple[float, Task]] = deque()  # (arrival time, task) not yet started, in order
        self.drifts: list[dict] = []
        self.now, self.wall_s, self.cpu_s = 0.0, 0.0, 0.0
        self.sections: dict[str, dict[str, float]] = defaultdict(lambda: {"wall_s": 0.0, "cpu_s": 0.0})

    @property
    def in_flight(self) -> int:
        return len(self.running)

    @contextmanager
    def _timed(self, name: str):
        w, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.sections[name]["wall_s"] += time.perf_counter() - w
            self.sections[name]["cpu_s"] += time.process_time() - c

    # -------------------------------------------------------------------- events
    def _push(self, t: float, kind: str, payload: Any = None) -> None:
        self._n_events += 1
        heapq.heappush(self.events, Event(t, ORDER[kind], self._n_events, kind, payload))

    def run(self, stream: list[Task | DriftEvent], scenario_rate: float = 0.0, log=print) -> Result:
        """`scenario_rate`: the rate the stream's created_at were drawn at (rescaled to SimConfig.rate)."""
        self.start(stream, scenario_rate)
        self.advance(log)
        return self.result()

    def start(self, stream: list[Task | DriftEvent], scenario_rate: float = 0.0) -> None:
        """A new run on `stream`: its tasks loaded and the first admission queued at time 0."""
        self.load(stream, scenario_rate)
        self._push(0.0, "tick")

    def load(self, stream: list[Task | DriftEvent], scenario_rate: float = 0.0) -> None:
        """The stream's tasks still to start (after the `started_tasks` already started) and its drift events."""
        tasks = [m for m in stream if isinstance(m, Task)]
        times = arrival_times(tasks, scenario_rate, self.sim.rate)
        self.arrivals = deque(itertools.islice(zip(times, tasks), self.started_tasks, None))
        self.drifts = [msgspec.structs.asdict(m) for m in stream if isinstance(m, DriftEvent)]

    def advance(self, log=print, before_task: int | None = None) -> bool:
        """Process events until none is left; with `before_task`, stop before the first admission that would start
        task number `before_task` of the stream or a later one (the event stays queued). True when stopped there."""
        t_wall, t_cpu, last_log = time.monotonic(), time.process_time(), time.monotonic()
        try:
            while self.events:
                ev = self.events[0]
                if ev.kind == "tick" and before_task is not None and \
                        self.started_tasks + self._admissible(ev.time) > before_task:
                    return True
                heapq.heappop(self.events)
                self.now = ev.time
                if ev.kind == "join":
                    self._join(ev.payload, self.now)
                elif ev.kind == "publish":
                    self.rollout_version = ev.payload
                    self._maybe_train(self.now)
                else:
                    self._admit(self.now)
                    if self.arrivals or self.in_flight:
                        self._push(self.now + self.sim.tick_s, "tick")
                if time.monotonic() - last_log > 30:
                    last_log = time.monotonic()
                    log(f"[harness {time.monotonic() - t_wall:5.0f}s] sim {self.now:8.1f}s rows {len(self.rows)} "
                        f"step {self.trainer.step} in flight {self.in_flight}")
            return False
        finally:
            self.wall_s += time.monotonic() - t_wall
            self.cpu_s += time.process_time() - t_cpu

    def result(self) -> Result:
        traj, steps = pd.DataFrame(self.rows), pd.DataFrame(self.steps)
        rec = drift_recoveries(traj, self.drifts, steps if len(steps) else None) if self.drifts and len(traj) else \
            pd.DataFrame()
        counts = {k: int(v) for k, v in self.trainer.admission.counts.items()}
        counts["unused_at_end"] = len(self.trainer.batcher.pending())
        sections = {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in self.sections.items()}
        return Result(traj, steps, self.drifts, rec, self.wall_s, self.now, counts, self.cpu_s, sections)

    def share_costs(self, k: int) -> None:
        """Count 1/k of the wall, CPU and section times so far: the part of a run shared by k branches."""
        self.wall_s, self.cpu_s = self.wall_s / k, self.cpu_s / k
        for v in self.sections.values():
            for key in v:
                v[key] /= k

    # -------------------------------------------------------------------- the learner
    def _maybe_train(self, now: float) -> None:
        while now >= self.busy_until and self.trainer.batcher.has_batch():
            trajs = self.trainer.batcher.take()
            if not self.sim.train:
                for t in trajs:
                    self.rows[self.row_of[t.traj_id]]["status"] = "untrained (frozen)"
                continue
            self._train(trajs, now)
            if self.sim.mode == "sync_overprovision":
                self._drop_stragglers(now)
            if self.sim.learner_step_s > 0:
                self.busy_until = now + self.sim.learner_step_s
                self._push(self.busy_until, "publish", self.trainer.version)
                return
            self.rollout_version = self.trainer.version

    def _drop_stragglers(self, now: float) -> None:
        """sync_overprovision: the round's rollouts still running when its batch is trained are dropped."""
        for traj_id in self.running:
            self.rows[self.row_of[traj_id]].update(status="straggler dropped", joined_at=now)
        self.dropped |= self.running
        self.running.clear()

    def _train(self, trajs: list[Trajectory], now: float) -> None:
        v, eta = self.trainer.vindex, self.sim.eta
        fresh = [t for t in trajs if staleness(t, v) <= eta]  # what split_stale keeps (one version per group)
        t0 = time.monotonic()
        with self._timed("train"):
            event = self.trainer.train_on(trajs)
        wall = time.monotonic() - t0
        for t in trajs:
            row = self.rows[self.row_of[t.traj_id]]
            ok = event is not None and staleness(t, v) <= eta
            row.update(status="trained" if ok else "stale", trained_step=event.step if ok else -1,
                       staleness_at_train=staleness(t, v))
        if event is None:
            return
        stal = [staleness(t, v) for t in fresh]
        self.steps.append({"step": event.step, "version": event.version, "skipped": event.skipped,
                           "n": event.n_trajectories, "n_tokens": event.n_tokens, "sim_time": now,
                           "staleness_mean": sum(stal) / len(stal), "staleness_max": max(stal),
                           "wall_step_s": wall, **event.metrics})  # incl. learner/ess_frac, the weights' ESS


def simulate(sim: SimConfig, init: str, stream: list[Task | DriftEvent], learner_sets: list[str] = (),
             agent_sets: list[str] = (), scenario_rate: float = 0.0, log=print,
             start_from: str | None = None) -> Result:
    return Harness(sim, init, learner_sets, agent_sets, start_from).run(stream, scenario_rate, log)


def save_start(models, path: str | Path) -> None:
    """The policy's weights (and the critic's, when there is one) as safetensors in `path`: a common start."""
    Path(path).mkdir(parents=True, exist_ok=True)
    save_model(models.policy, str(Path(path) / "policy.safetensors"))
    if models.value is not None:
        save_model(models.value, str(Path(path) / "value.safetensors"))


def load_start(models, path: str | Path) -> bool:
    """`save_start`'s policy into `models`; its critic too when the shapes match (True: the critic has trained).
    A critic of another depth gets the started policy's first blocks and keeps its fresh head (False), as one built
    from that policy would."""
    load_model(models.policy, str(Path(path) / "policy.safetensors"))
    saved = Path(path) / "value.safetensors"
    if models.value is None:
        return False
    if saved.is_file():
        with safe_open(str(saved), "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        if shapes == {k: tuple(v.shape) for k, v in models.value.state_dict().items()}:
            load_model(models.value, str(saved))
            return True
    backbone = models.value.backbone.state_dict()
    models.value.backbone.load_state_dict({k: v for k, v in models.policy.base_model.state_dict().items()
                                           if k in backbone})
    return False


def simulate_branches(sim: SimConfig, init: str, streams: list[list[Task | DriftEvent]], learner_sets: list[str] = (),
                      agent_sets: list[str] = (), scenario_rate: float = 0.0, log=print) -> list[Result]:
    """`simulate` of each stream, the tasks they all start with (`shared_tasks`) simulated once: each branch is a copy
    of the shared run taken just before the first admission that starts one of the streams' own tasks, so its Result
    is the one `simulate` gives on its stream alone (tests/test_harness.py); the shared part's wall, CPU and section
    times are split evenly between the branches. Async admission only: a synchronous round looks at how many tasks
    are left in the stream."""
    if sim.mode != "async":
        raise ValueError(f"simulate_branches: mode {sim.mode}; only async runs branch (a sync round reads the "
                         "stream's length)")
    shared = shared_tasks(streams)
    short = [i for i, s in enumerate(streams) if sum(isinstance(m, Task) for m in s) <= shared]
    if short:
        raise ValueError(f"simulate_branches: streams {short} have no task of their own after the {shared} shared")
    trunk = Harness(sim, init, learner_sets, agent_sets)
    trunk.start(streams[0], scenario_rate)
    trunk.advance(log, before_task=shared)
    trunk.share_costs(len(streams))
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    out = []
    for stream in streams:
        branch = copy.deepcopy(trunk)
        torch.set_rng_state(rng[0]), random.setstate(rng[1]), np.random.set_state(rng[2])
        branch.load(stream, scenario_rate)
        branch.advance(log)
        out.append(branch.result())
    return out

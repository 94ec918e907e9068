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

    .venv/bin/python -m experiments.harness --init runs/cache/warmstart-XXXX --scenario default --limit 2000
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
import time
from collections import OrderedDict, defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python -m experiments.harness`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from learner.config import LearnerConfig  # noqa: E402
from learner.engines import make_engine  # noqa: E402
from learner.models import CharTokenizer  # noqa: E402
from learner.train import build_models  # noqa: E402
from learner.trainer.loop import Trainer  # noqa: E402
from learner.trainer.staleness import staleness  # noqa: E402
from simulator.generator import generate  # noqa: E402
from simulator.latency import LatencyConfig  # noqa: E402
from simulator.scenario import Scenario, load_scenario, resolve_path  # noqa: E402
from streamer.agent.rollouts import run_tasks  # noqa: E402
from streamer.runs.recovery import drift_recoveries  # noqa: E402
from streamer.wire.config import load_config  # noqa: E402
from streamer.wire.schema import DriftEvent, PolicyVersion, Task, Trajectory  # noqa: E402
from streamer.wire.settings import AgentSettings  # noqa: E402

UNBOUNDED_TOKENS = 1 << 40  # batches close on their trajectory count alone
# How rollouts are started (SimConfig.mode). async: whenever fewer than max_in_flight run. The synchronous baselines
# start one round of `batch` rollouts at a time once a whole batch of tasks has arrived: sync waits for the round's
# last rollout and for the learner's step on it (eta 0); sync_one_step starts the next round as soon as the last one
# has finished, while the learner trains on it (eta 1); sync_overprovision starts batch x (1 + overprovision)
# rollouts, trains on the first `batch` to finish and drops the stragglers still running (eta 0).
MODES = {"async": None, "sync": 0, "sync_one_step": 1, "sync_overprovision": 0}  # mode -> the eta it implies


def default_latency() -> LatencyConfig:
    # lognormal with sigma 1.5: the median call is ~1/3 of the mean, 1 call in 100 takes ~8x the mean
    return LatencyConfig(kind="lognormal", mean_s=0.5, sigma=1.5, max_s=10.0, sleep=False)


@dataclass
class SimConfig:
    batch: int = 64  # B: trajectories per learner step (a multiple of group_size)
    eta: int = 4  # staleness bound: trajectories more than eta versions behind the learner are dropped
    group_size: int = 1  # rollouts per task (GRPO family: n)
    max_in_flight: int = 256  # rollouts in flight (a task of a group of n takes n): the same engine load for every arm
    tick_s: float = 0.25  # admission period (simulated s): tasks admitted together share one engine batch
    rate: float = 0.0  # task arrivals per simulated second; 0: as fast as admission allows
    gen_tokens_per_s: float = 100.0  # simulated generation speed of one rollout
    latency: LatencyConfig = field(default_factory=default_latency)  # each tool call's simulated latency
    learner_step_s: float = 0.0  # simulated duration of a learner step: its version is visible after it
    ring: int = 8  # policy snapshots kept
    train: bool = True  # False: the frozen control (no learner step; LearnerConfig refuses optim.lr=0)
    threads: int = 2
    seed: int = 0
    mode: str = "async"  # one of MODES
    # async admission paced by the learner, as the agents of `sao up` do (AReaL's staleness-bounded rollout): at
    # most tasks_per_version tasks per policy version, up to versions_ahead versions ahead of the newest one the
    # rollouts may use; 0: off (only max_in_flight bounds admission)
    tasks_per_version: int = 0
    versions_ahead: int = 1
    overprovision: float = 0.25  # sync_overprovision: extra rollouts started per round, as a fraction of batch

    def round_size(self) -> int:
        """Rollouts a synchronous round starts: a whole batch, over-provisioned to whole groups."""
        extra = self.overprovision if self.mode == "sync_overprovision" else 0.0
        return self.group_size * math.ceil(self.batch * (1.0 + extra) / self.group_size)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SimConfig.mode '{self.mode}': expected one of {list(MODES)}")
        if MODES[self.mode] is not None and self.eta != MODES[self.mode]:
            raise ValueError(f"SimConfig: mode {self.mode} trains at staleness {MODES[self.mode]}: set eta to it, "
                             f"got {self.eta}")
        if self.tasks_per_version < 0 or self.versions_ahead < 0:
            raise ValueError("SimConfig: tasks_per_version and versions_ahead >= 0")
        if self.mode != "async" and (self.overprovision < 0 or self.max_in_flight < self.round_size()):
            raise ValueError(f"SimConfig: mode {self.mode} starts {self.round_size()} rollouts a round: "
                             f"max_in_flight {self.max_in_flight} is too small (or overprovision < 0)")
        if self.group_size < 1 or self.batch < 1 or self.batch % self.group_size:
            raise ValueError(f"SimConfig: batch {self.batch} must be a positive multiple of group_size "
                             f"{self.group_size}")
        if self.eta < 0 or self.max_in_flight < self.group_size or self.ring < 1:
            raise ValueError("SimConfig: eta >= 0, max_in_flight >= group_size and ring >= 1")
        if not (self.tick_s > 0 and self.gen_tokens_per_s > 0 and self.rate >= 0 and self.learner_step_s >= 0):
            raise ValueError("SimConfig: tick_s, gen_tokens_per_s > 0; rate, learner_step_s >= 0")
        if self.latency.sleep:
            raise ValueError("SimConfig.latency.sleep must be False: the latency is simulated, not slept")


class SnapshotRing:
    """The learner's `Publisher` in one process: the newest `keep` policy versions as state dicts."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.snapshots: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def publish(self, model: torch.nn.Module, version: int, step: int) -> PolicyVersion:
        self.snapshots[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        while len(self.snapshots) > self.keep:
            self.snapshots.popitem(last=False)
        return PolicyVersion(version=version, uri=f"memory://v{version}", sha256="", step=step)

    def latest_version(self) -> int | None:
        return next(reversed(self.snapshots)) if self.snapshots else None

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.snapshots:
            raise KeyError(f"policy version {version} left the ring (keeps {self.keep}: {list(self.snapshots)})")
        return self.snapshots[version]


# ------------------------------------------------------------------------------------------- pure helpers

def arrival_times(tasks: list[Task], scenario_rate: float, rate: float) -> list[float]:
    """Simulated arrival of each task: its stream time rescaled to `rate` (0: all present at time 0)."""
    if rate <= 0:
        return [0.0] * len(tasks)
    if scenario_rate > 0:
        return [t.created_at * scenario_rate / rate for t in tasks]
    return [i / rate for i in range(len(tasks))]


def finish_time(start: float, gen_tokens: int, env_seconds: float, gen_tokens_per_s: float) -> float:
    return start + gen_tokens / gen_tokens_per_s + env_seconds


def phase_prefix(stream: list[Task | DriftEvent], n: int) -> list[Task | DriftEvent]:
    """The first ceil(k / n) tasks of each phase (k its tasks), drift events kept: with groups of n, every phase
    takes the same number of rollouts as with single rollouts, and its tasks are a prefix of theirs."""
    if n == 1:
        return list(stream)
    per_phase: dict[int, int] = {}
    for m in stream:
        if isinstance(m, Task):
            per_phase[m.phase] = per_phase.get(m.phase, 0) + 1
    seen: dict[int, int] = {}
    out: list[Task | DriftEvent] = []
    for m in stream:
        if isinstance(m, Task):
            seen[m.phase] = seen.get(m.phase, 0) + 1
            if seen[m.phase] > math.ceil(per_phase[m.phase] / n):
                continue
        out.append(m)
    return out


def scenario_stream(scn: Scenario, seed: int, limit: int | None = None) -> list[Task | DriftEvent]:
    return list(generate(scn, seed=seed, t0=0.0, limit=limit))


# ------------------------------------------------------------------------------------------- the simulation

@dataclass(order=True)
class _Event:
    time: float
    order: int  # joins before publications before ticks at one time, then FIFO
    seq: int
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


_ORDER = {"join": 0, "publish": 1, "tick": 2}


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


class Harness:
    def __init__(self, sim: SimConfig, init: str, learner_sets: list[str] = (), agent_sets: list[str] = ()) -> None:
        sim.validate()
        self.sim = sim
        torch.set_num_threads(sim.threads)
        sets = [f"io.init={init}", f"seed={sim.seed}", f"threads={sim.threads}", f"batch.max_staleness={sim.eta}",
                f"batch.max_trajectories={sim.batch}", f"batch.tokens={UNBOUNDED_TOKENS}", *learner_sets]
        if sim.group_size > 1:
            sets.append(f"advantage.group_size={sim.group_size}")
        self.cfg = load_config(LearnerConfig, None, sets)
        if (self.cfg.advantage.estimator != "gae") != (sim.group_size > 1):
            raise ValueError(f"estimator {self.cfg.advantage.estimator} with group_size {sim.group_size}: a group "
                             "estimator needs groups (group_size > 1) and gae single rollouts")
        self.agent = load_config(AgentSettings, None, [f"seed={sim.seed}", f"group_size={sim.group_size}",
                                                       *agent_sets])
        self.models = build_models(self.cfg)
        self.ring = SnapshotRing(sim.ring)
        self.trainer = Trainer(self.cfg, self.models, source=None, publisher=self.ring)
        self.trainer.start()  # publishes version 0 into the ring
        self.tok = CharTokenizer()
        self.engine = make_engine("torch", copy.deepcopy(self.models.policy), self.tok)
        self.rollout_version = 0  # the newest version rollouts may start with
        self.busy_until = 0.0
        self.events: list[_Event] = []
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
        heapq.heappush(self.events, _Event(t, _ORDER[kind], self._n_events, kind, payload))

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

    # -------------------------------------------------------------------- admission and rollouts
    def _room(self, now: float) -> int:
        """Rollouts that may start now (see MODES)."""
        if self.sim.mode == "async":
            room = self.sim.max_in_flight - self.in_flight
            if self.sim.tasks_per_version:
                versions = self.rollout_version + 1 + self.sim.versions_ahead
                room = min(room, (versions * self.sim.tasks_per_version - self.started_tasks) * self.sim.group_size)
            return room
        idle = now >= self.busy_until and not self.trainer.batcher.has_batch()
        if self.in_flight or (self.sim.mode != "sync_one_step" and not idle):
            return 0
        size, n = self.sim.round_size(), self.sim.group_size
        arrived = sum(1 for _ in itertools.islice(itertools.takewhile(lambda a: a[0] <= now, self.arrivals), size // n))
        whole = arrived * n >= size or arrived == len(self.arrivals)  # a whole round has arrived, or the stream's rest
        return size if whole else 0

    def _admissible(self, now: float) -> int:
        """Tasks an admission at `now` starts: the arrived ones at the head of the queue that `_room` has room for."""
        room = max(self._room(now) // self.sim.group_size, 0)
        return sum(1 for _ in itertools.takewhile(lambda a: a[0] <= now, itertools.islice(self.arrivals, room)))

    def _admit(self, now: float) -> None:
        batch = [self.arrivals.popleft()[1] for _ in range(self._admissible(now))]
        if not batch:
            return
        version = self.rollout_version
        if self.engine.version != version:
            with self._timed("load"):
                self.engine.load_state_dict(self.ring.get(version), version=version)
        agent = dataclasses.replace(self.agent, concurrency=len(batch))
        with self._timed("generate"):
            done = run_tasks(self.engine, self.tok, batch, agent, latency=self.sim.latency)
        self.started_tasks += len(batch)
        for task, trajs in zip(batch, done):
            finishes = [finish_time(now, sum(t.loss_mask), t.env_seconds, self.sim.gen_tokens_per_s) for t in trajs]
            for member, (t, fin) in enumerate(zip(trajs, finishes)):
                self._row(task, member, t, now, fin)
            self._push(max(finishes), "join", trajs)  # a group joins when its last member finishes

    def _row(self, task: Task, member: int, t: Trajectory, start: float, fin: float) -> None:
        n_gen = sum(t.loss_mask)
        self.row_of[t.traj_id] = len(self.rows)
        self.running.add(t.traj_id)
        self.rows.append({
            "seq": task.seq, "member": member, "task_id": t.task_id, "traj_id": t.traj_id, "phase": t.phase,
            "family": t.family, "concept": t.concept, "reward": t.reward, "success": t.success,
            "policy_version": t.policy_version, "n_gen": n_gen, "n_tokens": len(t.tokens),
            "n_tool_calls": t.n_tool_calls, "started_at": start, "gen_s": n_gen / self.sim.gen_tokens_per_s,
            "env_s": t.env_seconds, "finished_at": fin, "joined_at": math.nan,
            "learner_version_at_join": -1, "staleness": -1, "status": "in flight", "trained_step": -1,
            "staleness_at_train": -1})

    def _join(self, trajs: list[Trajectory], now: float) -> None:
        if trajs[0].traj_id in self.dropped:  # a straggler of sync_overprovision: already dropped
            return
        self.running.difference_update(t.traj_id for t in trajs)
        v = self.trainer.vindex
        for t in trajs:
            row = self.rows[self.row_of[t.traj_id]]
            verdict = self.trainer.admission.admit(t, v)
            row.update(joined_at=now, learner_version_at_join=v, staleness=staleness(t, v),
                       status="buffered" if verdict == "ok" else verdict)
            if verdict == "ok":
                self.trainer.batcher.add(t)
        self._maybe_train(now)

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
             agent_sets: list[str] = (), scenario_rate: float = 0.0, log=print) -> Result:
    return Harness(sim, init, learner_sets, agent_sets).run(stream, scenario_rate, log)


def shared_tasks(streams: list[list[Task | DriftEvent]]) -> int:
    """How many tasks every stream starts with, equal in every field."""
    enc = [[msgspec.json.encode(m) for m in s if isinstance(m, Task)] for s in streams]
    return next((i for i, same in enumerate(zip(*enc)) if len(set(same)) > 1), min(map(len, enc)))


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


def by_phase(traj: pd.DataFrame) -> list[dict]:
    """Mean reward and trajectories of each (phase, family, concept), and what happened to them."""
    out = []
    for (ph, fam, con), g in traj.sort_values(["seq", "member"]).groupby(["phase", "family", "concept"]):
        r = g["reward"].to_numpy(float)
        out.append({"phase": int(ph), "family": fam, "concept": con, "n": int(len(r)), "reward": float(r.mean()),
                    "first64": float(r[:64].mean()), "last64": float(r[-64:].mean()),
                    "trained": int((g["status"] == "trained").sum()), "stale": int((g["status"] == "stale").sum())})
    return out


def summary(res: Result, threads: int) -> dict[str, Any]:
    t = res.trajectories
    trained = t[t["status"] == "trained"] if len(t) else t
    return {"trajectories": int(len(t)), "learner_steps": int(len(res.steps)), "wall_s": round(res.wall_s, 2),
            "sim_s": round(res.sim_s, 2), "trajectories_per_wall_s": round(res.per_wall_s, 1),
            "cpu_s": round(res.cpu_s, 2), "trajectories_per_cpu_s_per_thread": round(res.per_cpu_s(threads), 1),
            "sections": res.sections,
            "trained": int(len(trained)), "reward_mean": float(t["reward"].mean()) if len(t) else math.nan,
            "staleness_at_train": {str(k): int(v) for k, v in
                                   trained["staleness_at_train"].value_counts().sort_index().items()},
            "counts": res.counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="warm-start policy directory")
    p.add_argument("--scenario", default="default")
    p.add_argument("--limit", type=int, default=2000, help="the first tasks of the stream")
    p.add_argument("--sim", action="append", default=[], metavar="KEY=VALUE", help="SimConfig field")
    p.add_argument("--set", dest="learner", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--agent-set", dest="agent", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="", help="write <out>.json (summary, by-phase table, recoveries, steps)")
    a = p.parse_args(argv)
    sim = load_config(SimConfig, None, a.sim)
    scn = load_scenario(resolve_path(a.scenario))
    stream = phase_prefix(scenario_stream(scn, sim.seed, a.limit), sim.group_size)
    res = simulate(sim, a.init, stream, a.learner, a.agent, scn.rate)
    out = {"sim": dataclasses.asdict(sim), "summary": summary(res, sim.threads), "by_phase": by_phase(res.trajectories),
           "recoveries": res.recoveries.to_dict("records"), "steps": res.steps.to_dict("records")}
    print(json.dumps(out["summary"], indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + ".json").write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

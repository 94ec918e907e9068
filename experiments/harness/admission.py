"""Admission: which rollouts start at a tick and with which policy version (the snapshot ring), and their joins to
the learner's buffer when they finish."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import OrderedDict

import torch

from experiments.harness.clock import finish_time
from learner.trainer.staleness import staleness
from streamer.agent.rollouts import run_tasks
from streamer.wire.schema import PolicyVersion, Task, Trajectory

UNIFORM_DROPPED = "uniform group dropped"  # a row's status: its group dropped by DAPO's dynamic sampling


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


class RolloutAdmission:
    """The admission half of `Harness` (experiments.harness.loop): starting rollouts at a tick (see MODES) and joining
    them to the learner's buffer when they finish. It reads and updates the harness's state: `sim`, `trainer`,
    `engine`, `ring`, `agent`, `tok`, `arrivals`, `rows`, `row_of`, `running`, `dropped`, `started_tasks`,
    `rollout_version`, `busy_until`, and calls its `_timed`, `_push` and `_maybe_train`."""

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
        v, uniform = self.trainer.vindex, self.trainer.batcher.dropped_uniform
        for t in trajs:
            row = self.rows[self.row_of[t.traj_id]]
            verdict = self.trainer.admission.admit(t, v)
            row.update(joined_at=now, learner_version_at_join=v, staleness=staleness(t, v),
                       status="buffered" if verdict == "ok" else verdict)
            if verdict == "ok":
                self.trainer.batcher.add(t)
        if self.trainer.batcher.dropped_uniform > uniform:  # the group's rewards were all equal: dynamic sampling
            for t in trajs:
                if self.rows[self.row_of[t.traj_id]]["status"] == "buffered":
                    self.rows[self.row_of[t.traj_id]]["status"] = UNIFORM_DROPPED
        self._maybe_train(now)

"""Poison batches: a batch that keeps failing is dead-lettered with its error instead of being redone forever.

A batch whose training raises (any exception, `torch.OutOfMemoryError`, `MemoryError`) used to crash the learner,
which resumed from its checkpoint, read the same records, formed the same batch and crashed again until `sao up`'s
restarts were spent. Now each failure adds one to the count of every trajectory of the batch, kept in
`<checkpoint.dir>/quarantine.json` (written atomically before the learner goes down, so the count survives the
crash). A trajectory that has failed `batch.poison_after` times is poison: it goes to the dead-letter topic with
the reason "poison batch: <error>" (a group estimator's whole group with it, since a batch never splits a group).
Counting trajectories rather than whole batches follows the culprit even when the batch around it differs after a
restart (records of several partitions interleave differently).

The failure that reaches the count is handled in the same process when the batch left the weights as they were
(no optimizer step had run: `learner.trainer.step.HalfApplied` says otherwise) and there is one rank: the learner
trains the batch's halves as batches of their own, halving again each half that fails, so that only the units
(trajectories, or groups) that fail alone are dead-lettered (`Trainer._isolate`); a batch that failed only for its
size (out of memory) trains whole in halves. Otherwise the learner goes down once more and the restarted one
dead-letters the poison trajectories when the batch forms again. A failure below the count always takes the
learner down: a restart clears what a fault of the machine leaves behind (a broken device context), so nothing is
dead-lettered before its batch has failed after a fresh start too.

The learner remembers each buffered trajectory's source offset (`remember`, and in its checkpoints: `state`) so
that its dead letter names the record, as every other dead letter does.

Fault injection (tests, drills): `$SAO_FAULT_POISON_TASK=<task id>` makes every batch holding that task fail with a
`torch.OutOfMemoryError`, deterministically, in `injected_fault` alone: no input the learner admits makes its step
raise (admission refuses what the forward pass would crash on, and a non-finite loss skips the step).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from learner.trainer.checkpoint import write_atomic
from learner.trainer.source import Offset, Source
from streamer.wire.schema import Trajectory

log = logging.getLogger(__name__)
FILE = "quarantine.json"
REASON = "poison batch"
MAX_ENTRIES = 10_000  # trajectories remembered, the oldest forgotten first (only failed batches add any)
FAULT_ENV = "SAO_FAULT_POISON_TASK"


def injected_fault(trajs: list[Trajectory]) -> None:
    """The one place the fault-injection variable is read (see the module's docstring)."""
    task = os.environ.get(FAULT_ENV)
    if task and any(t.task_id == task for t in trajs):
        raise torch.OutOfMemoryError(f"injected by ${FAULT_ENV}={task}")


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


class Quarantine:
    def __init__(self, root: str | Path, after: int, key: Callable[[Trajectory], str]) -> None:
        """`root`: checkpoint.dir; `after`: failures that make a trajectory poison; `key`: a trajectory's identity
        (the admission's de-duplication key)."""
        self.path = Path(root) / FILE
        self.after, self.key = after, key
        self.failures: dict[str, dict] = self._load()  # key -> {"failures": n, "error": the last one}
        self.offsets: dict[str, Offset] = {}

    def _load(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
            return {str(k): {"failures": int(v["failures"]), "error": str(v["error"])} for k, v in data.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.error("%s unreadable (%s): failure counts start again from zero", self.path, e)
            return {}

    def _save(self) -> None:
        while len(self.failures) > MAX_ENTRIES:
            self.failures.pop(next(iter(self.failures)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self.failures, indent=1).encode())

    # ------------------------------------------------------------------ offsets of buffered trajectories
    def remember(self, traj: Trajectory, off: Offset) -> None:
        self.offsets[self.key(traj)] = off

    def state(self, pending: list[Trajectory]) -> dict[str, list]:
        """The offsets of `pending` (a checkpoint's buffered trajectories); forgets every other one."""
        keys = {self.key(t) for t in pending}
        self.offsets = {k: off for k, off in self.offsets.items() if k in keys}
        return {k: list(off) for k, off in self.offsets.items()}

    def load_state(self, offsets: dict[str, list]) -> None:
        self.offsets = {k: Offset(str(p), int(o), int(n)) for k, (p, o, n) in offsets.items()}

    # ------------------------------------------------------------------ failures
    def poisoned(self, traj: Trajectory) -> str | None:
        """The error of a poison trajectory; None for any other."""
        entry = self.failures.get(self.key(traj))
        return entry["error"] if entry and entry["failures"] >= self.after else None

    def failed(self, trajs: list[Trajectory], error: BaseException) -> bool:
        """Count a failure of the batch `trajs` (persisted at once); True when one of them is now poison."""
        for t in trajs:
            entry = self.failures.setdefault(self.key(t), {"failures": 0, "error": ""})
            entry["failures"] += 1
            entry["error"] = describe(error)
        self._save()
        worst = max(self.failures[self.key(t)]["failures"] for t in trajs)
        log.error("batch of %d trajectories failed (%s): failure %d (poison from %d: halved, dead-lettered alone)",
                  len(trajs), describe(error), worst, self.after)
        return worst >= self.after

    def trained(self, trajs: list[Trajectory]) -> None:
        """A batch trained: its trajectories' failures (a fault of the machine, not theirs) are forgotten."""
        for t in trajs:
            self.offsets.pop(self.key(t), None)
        forgotten = [self.failures.pop(self.key(t), None) for t in trajs] if self.failures else []
        if any(forgotten):
            self._save()

    @staticmethod
    def units(trajs: list[Trajectory], group: Callable[[Trajectory], str] | None) -> list[list[Trajectory]]:
        """`trajs` as the units a batch never splits: each trajectory, or with `group` each group, in order."""
        if group is None:
            return [[t] for t in trajs]
        out: dict[str, list[Trajectory]] = {}
        for t in trajs:
            out.setdefault(group(t), []).append(t)
        return list(out.values())

    def split(self, trajs: list[Trajectory], group: Callable[[Trajectory], str] | None) -> tuple[list, list]:
        """(to train, poison): with `group`, a poison trajectory takes its whole group with it."""
        bad = {self.key(t) for t in trajs if self.poisoned(t) is not None}
        if group is not None:
            groups = {group(t) for t in trajs if self.key(t) in bad}
            bad |= {self.key(t) for t in trajs if group(t) in groups}
        return [t for t in trajs if self.key(t) not in bad], [t for t in trajs if self.key(t) in bad]

    def dead_letter(self, trajs: list[Trajectory], source: Source, error: str | None = None) -> None:
        """Each of `trajs` to the source's dead letters with "poison batch: <error>" (its own recorded error, or
        `error` for the members of a group that came with it)."""
        for t in trajs:
            reason = f"{REASON}: {self.poisoned(t) or error or 'its group holds a poison trajectory'}"
            off = self.offsets.pop(self.key(t), None)
            if off is None:  # buffered in a checkpoint written before offsets were kept
                log.error("%s (task %s): %s; its source offset is unknown, so no dead letter names it",
                          t.traj_id, t.task_id, reason)
                continue
            source.reject(t, off, reason)

"""The simulated setting of a harness run (SimConfig) and how its rollouts are started (MODES)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from simulator.latency import LatencyConfig

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

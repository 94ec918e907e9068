"""How `sao up` shares a small machine: threads per role, learner first, and learner-paced generation.

Six processes with several torch threads each on 2 cores starve the learner (CALIBRATION.md: 43-119 tokens/s
inside the pipeline against 4,059 alone, 8 steps for 6,000 trajectories). The plan gives the learner its
cores first, one agent per remaining core, one torch/OpenMP thread per agent, and lowers the CPU priority
(nice) of everything that is not the learner, so a learner step runs at close to its isolated speed and agents
use the cycles it leaves. The held-out evaluator is off on 2 cores or fewer unless asked for.

Pacing (`paced_admission`): one setting, the staleness bound, drives both the learner's `max_staleness` and
the agents' admission (AReaL's eta). Each agent starts `tasks_per_version` tasks per policy version, so all
agents together generate one learner batch per version, and runs at most `versions_ahead = staleness - 1`
versions ahead: a trajectory is trained at most `staleness` versions after the one that generated it (one
version of margin for weight propagation), so agents never generate what the learner would drop.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from streamer.wire.config import ConfigError

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
SIDE_NICE = 10  # metrics app, dashboard, evaluator, simulator: whatever the learner and agents leave
AGENT_NICE = 5  # agents yield the CPU to the learner, whose steps gate every new version


@dataclass(frozen=True)
class ResourcePlan:
    cores: int
    learner_threads: int
    agents: int
    agent_threads: int
    eval: bool

    def describe(self) -> str:
        ev = "on" if self.eval else "off"
        return (f"resource plan for {self.cores} cores: learner {self.learner_threads} thread(s), "
                f"{self.agents} agent(s) x {self.agent_threads} thread(s) at nice {AGENT_NICE}, evaluator {ev}, "
                f"side roles at nice {SIDE_NICE}")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_resources(cores: int, agents: int = 0, eval: bool | None = None) -> ResourcePlan:
    """The learner gets half the cores (at most 4), agents one core each of the rest (at most 4 by default);
    `agents` / `eval` given explicitly are kept. eval None: on above 2 cores."""
    if cores < 1:
        raise ConfigError(f"resources: {cores} cores; need at least 1")
    if agents < 0:
        raise ConfigError(f"--agents {agents}: need at least one agent (0 = from the resource plan)")
    learner = min(4, max(1, cores // 2))
    rest = max(1, cores - learner)
    n_agents = agents or min(4, rest)
    return ResourcePlan(cores=cores, learner_threads=learner, agents=n_agents,
                        agent_threads=max(1, rest // n_agents), eval=cores > 2 if eval is None else eval)


def thread_env(threads: int) -> dict[str, str]:
    """Environment that caps a child's OpenMP/MKL pools (torch.set_num_threads covers only intra-op)."""
    return {k: str(threads) for k in THREAD_VARS}


@dataclass(frozen=True)
class Admission:
    tasks_per_version: int
    versions_ahead: int
    concurrency: int


def paced_admission(staleness: int, batch_trajectories: int, agents: int, group_size: int = 1) -> Admission:
    """Agent admission from the learner's batch and staleness bound (see the module docstring).

    staleness 0 is the synchronous baseline: each agent answers its share of one batch, then waits."""
    if staleness < 0:
        raise ConfigError(f"staleness: {staleness} must be >= 0 (versions a trajectory may lag the learner)")
    if batch_trajectories < 1 or agents < 1 or group_size < 1:
        raise ConfigError("paced_admission: batch_trajectories, agents and group_size must be >= 1")
    tasks = math.ceil(batch_trajectories / (agents * group_size))
    return Admission(tasks_per_version=tasks, versions_ahead=max(0, staleness - 1), concurrency=tasks)


def check_pacing(adm: Admission, agents: int, group_size: int, batch_trajectories: int, staleness: int) -> None:
    """Agents bounded by versions must be able to fill a batch, and must not outrun the learner's bound."""
    per_round = adm.tasks_per_version * agents * group_size
    if per_round < batch_trajectories:
        raise ConfigError(f"admission: {agents} agent(s) x tasks_per_version {adm.tasks_per_version} x group "
                          f"{group_size} = {per_round} trajectories per version < the learner's batch "
                          f"{batch_trajectories}: the learner would wait forever; raise tasks_per_version")
    if staleness and adm.versions_ahead >= staleness:
        raise ConfigError(f"admission: versions_ahead {adm.versions_ahead} >= staleness {staleness}: agents "
                          f"would generate trajectories the learner drops; use versions_ahead <= staleness - 1")

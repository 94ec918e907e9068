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

The fixed rule above was made for the embedded toy policy, where the agents are the bottleneck. With a pretrained
`--model` (SmolLM2-135M: a learner step of 32 trajectories took 20-60 s on one thread while the agent sat idle),
`sao up` measures instead (`streamer.launch.plan_measure`), unless --agents, launch.learner_threads or
launch.agent_threads is given (then the rule applies, with those kept):
  - what: one learner update (`learner.trainer.step` prepare + update, the run's learner settings, a real forward
    and backward) on a synthetic batch of the run's shape (--batch trajectories of PROMPT_TOKENS prompt tokens and
    agent.max_new_tokens generated ones), and one engine generating that whole batch (eos off: every row the full
    length), each on 1 and 2 torch threads, in a child of `sao up` before any role starts. Cached per model,
    cores, shape and learner settings under runs/cache; the figures and the choice go to <run>/resource_plan.json.
  - model (`version_seconds`): a side's seconds on t threads follow Amdahl's law through its 1- and 2-thread times;
    a side slower on 2 threads than on 1 (a busy machine) counts as serial: no thread given to it. n agents of k
    threads each generate 1/n of the batch (linear in rows: a smaller batch costs more per row, so this flatters
    many agents). Learner and agents overlap (staleness >= 1): a version takes the
    slower side's time, or, when their threads oversubscribe the cores, the core-seconds both need over the cores
    (agents run at nice 5 and are paced: they mostly wait while a slow learner steps). Synchronous (--sync): the
    sum. Not counted: publishing and loading each version's weights, multi-turn episodes, the side roles.
  - choice (`choose_plan`): every split (learner 1..cores threads, 1..4 agents x k threads within the cores) is
    scored by trajectories trained per second (batch / version seconds); among those within TIE of the best, the
    fewest threads, then the fewest agents (each holds a copy of the model).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from streamer.wire.config import ConfigError

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
MAX_AGENTS = 4  # the rule's and the measured plan's cap: each agent holds a copy of the model
TIE = 0.01  # measured splits within 1% of the best count as equal (timings on a shared machine are noisier)
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


def plan_resources(cores: int, agents: int = 0, eval: bool | None = None, learner_threads: int = 0,
                   agent_threads: int = 0) -> ResourcePlan:
    """The learner gets half the cores (at most 4), agents one core each of the rest (at most 4 by default);
    `agents`, `eval`, `learner_threads` and `agent_threads` given explicitly are kept. eval None: on above 2 cores."""
    if cores < 1:
        raise ConfigError(f"resources: {cores} cores; need at least 1")
    if agents < 0:
        raise ConfigError(f"--agents {agents}: need at least one agent (0 = from the resource plan)")
    if learner_threads < 0 or agent_threads < 0:
        raise ConfigError(f"launch.learner_threads {learner_threads}, launch.agent_threads {agent_threads}: must be "
                          f">= 0 (0 = from the resource plan)")
    learner = learner_threads or min(4, max(1, cores // 2))
    rest = max(1, cores - learner)
    n_agents = agents or min(MAX_AGENTS, rest)
    return ResourcePlan(cores=cores, learner_threads=learner, agents=n_agents,
                        agent_threads=agent_threads or max(1, rest // n_agents),
                        eval=cores > 2 if eval is None else eval)


@dataclass(frozen=True)
class Timings:
    """Measured seconds of one policy version's work, on 1 and 2 threads: the learner's update of one batch, and
    one agent generating the whole batch."""

    learner_s: tuple[float, float]
    agents_s: tuple[float, float]


def seconds_on(t1: float, t2: float, threads: int) -> float:
    """Amdahl's law through the 1- and 2-thread times: serial fraction s = 2 t2 / t1 - 1, clamped to [0, 1]."""
    s = min(1.0, max(0.0, 2 * t2 / t1 - 1))
    return t1 * (s + (1 - s) / threads)


def version_seconds(t: Timings, cores: int, learner_threads: int, agents: int, agent_threads: int,
                    staleness: int) -> float:
    """Seconds per policy version of this split (module docstring): overlapped unless synchronous, bounded by the
    core-seconds both sides need when their threads oversubscribe the cores."""
    learn = seconds_on(*t.learner_s, learner_threads)
    gen = seconds_on(*t.agents_s, agent_threads) / agents
    if staleness == 0:
        return learn + gen
    return max(learn, gen, (learn * learner_threads + gen * agents * agent_threads) / cores)


def choose_plan(cores: int, t: Timings, staleness: int, eval: bool | None = None) -> tuple[ResourcePlan, float]:
    """The split with the most trajectories trained per second, and its seconds per version (module docstring)."""
    if cores < 1:
        raise ConfigError(f"resources: {cores} cores; need at least 1")
    if min(*t.learner_s, *t.agents_s) <= 0 or not all(map(math.isfinite, (*t.learner_s, *t.agents_s))):
        raise ConfigError(f"resources: measured timings {t} must be finite and > 0")
    options = [(version_seconds(t, cores, lt, n, k, staleness), lt, n, k) for lt in range(1, cores + 1)
               for n in range(1, min(MAX_AGENTS, cores) + 1) for k in range(1, cores // n + 1)]
    best = min(o[0] for o in options)
    near = [o for o in options if o[0] <= best * (1 + TIE)]
    secs, lt, n, k = min(near, key=lambda o: (o[1] + o[2] * o[3], o[2], o[0]))  # fewest threads, then agents
    plan = plan_resources(cores, n, eval, learner_threads=lt, agent_threads=k)
    return plan, secs


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

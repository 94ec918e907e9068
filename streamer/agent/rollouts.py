"""Rollouts of tasks in flight: episodes of several tasks share the engine's batches, tool calls overlap.

An agent keeps up to `concurrency` tasks in flight (each with `group_size` episodes). Every `advance`
generates one turn, in one engine batch per stop set, for all the episodes that are ready, then hands
each action to its environment on a thread pool, so a slow tool call (the simulator's latency)
blocks only its own episode while the others keep generating: the continuous batching of rollout
services (slime, AReaL) on the agent side. The episodes of one task wait for each other at every
turn, so with one task in flight a group is generated in one batch per turn and a rollout is
reproducible from its task id and seed. New weights may be loaded between two `advance` calls; a
trajectory then records every version that generated it (`policy_versions`) and its oldest one as
`policy_version`, and its behaviour log-probs are those actually sampled, at the `temperature` it
carries (the learner scores at that temperature; a greedy one, temperature 0, is not trained on).
This is the project's one episode loop: the agents, the evaluator and the warm start's held-out
evaluation (`learner.pretrain.evaluate`, through `run_tasks`) all run it.
"""

from __future__ import annotations

import logging
import time
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from streamer.wire.schema import Task, Trajectory
from streamer.wire.settings import AgentSettings

log = logging.getLogger(__name__)


ROLLOUT_ERRORS = (ValueError, KeyError, TypeError, IndexError)  # the task's own fault: dead-lettered
# The machine's fault, not the task's (torch.OutOfMemoryError is a RuntimeError): the batch is retried after a
# backoff, and after ENGINE_RETRIES failures in a row the agent stops with EngineError, committing nothing.
INFRA_ERRORS = (RuntimeError, MemoryError, OSError)
ENGINE_RETRIES = 5
ENGINE_BACKOFF_S = 0.5  # first wait after a failure; doubles each time, at most 10 s


class EngineError(Exception):
    """Generation failed ENGINE_RETRIES times in a row: the engine (or the machine) is broken, not the task."""


class TaskError(ValueError):
    """The environment raised on this task's action (a task fault, dead-lettered with the original error named)."""


def rollout_seed(task_id: str, seed: int) -> int:
    return zlib.crc32(f"{seed}:{task_id}".encode())


def context_limit(engine: Any) -> int:
    model = getattr(engine, "model", None)
    return int(getattr(getattr(model, "config", None), "max_position_embeddings", 0) or 1 << 30)


@dataclass(eq=False)
class Episode:
    env: Any
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    final: Any = None  # the env's last Step
    pending: Future | None = None  # the env step in progress
    turns: int = 0
    gen_seconds: float = 0.0
    versions: list[int] = field(default_factory=list)


@dataclass(eq=False)
class InFlight:
    task: Task
    key: Any  # the caller's handle (the agent's partition and offset)
    episodes: list[Episode]
    prompt_len: int
    seed: int
    started: float
    error: Exception | None = None  # the environment or engine raised: no more turns

    @property
    def done(self) -> bool:
        return all(e.final is not None for e in self.episodes)

    @property
    def idle(self) -> bool:
        """Every episode is back from its environment."""
        return all(e.pending is None for e in self.episodes)

    @property
    def ready(self) -> bool:
        """Idle, and at least one episode still needs a turn."""
        return self.error is None and not self.done and self.idle


@dataclass
class Finished:
    task: Task
    key: Any
    trajectories: list[Trajectory]
    error: Exception | None = None  # the environment or engine raised: the task goes to the DLQ


class Rollouts:
    """Tasks in flight on one engine. `start` a task, call `advance` until it returns the task."""

    def __init__(self, engine: Any, tokenizer: Any, s: AgentSettings, agent_id: str = "", latency: Any = None) -> None:
        from simulator import verifiers

        verifiers.set_timeout(s.verifier_timeout_s)  # user verifiers: killed past it, their task dead-lettered
        self.engine, self.tokenizer, self.s, self.agent_id = engine, tokenizer, s, agent_id
        self.latency = latency  # a LatencyConfig for every tool call, instead of each task's own
        self.limit = context_limit(engine)
        self.flights: list[InFlight] = []
        self._pool: ThreadPoolExecutor | None = None
        self.engine_failures = 0  # generation failures in a row (INFRA_ERRORS)

    def __len__(self) -> int:
        return len(self.flights)

    def start(self, task: Task, key: Any = None) -> None:
        from simulator.env import Markup, make_env

        seed = rollout_seed(task.task_id, self.s.seed)
        markup = Markup(*self.s.tool_call, *self.s.observation)
        eps = []
        try:
            for _ in range(self.s.group_size):
                env = make_env(task, self.latency, markup)
                prompt = self.tokenizer.encode_prompt(env.prompt(), env.messages())
                eps.append(Episode(env, list(prompt), [0] * len(prompt), [0.0] * len(prompt)))
        except ROLLOUT_ERRORS as e:  # returned by the next `advance`
            self.flights.append(InFlight(task, key, [], 0, seed, time.time(), error=e))
            return
        self.flights.append(InFlight(task, key, eps, len(eps[0].tokens), seed, time.time()))

    def advance(self, timeout: float | None = None) -> list[Finished]:
        """One turn for every ready task; else wait up to `timeout` for an environment. Returns the
        tasks that ended (their trajectories, or the error that ended them)."""
        ready = [f for f in self.flights if f.ready]
        for batch in self._batches(ready):
            try:
                self._generate(batch)
                self.engine_failures = 0
            except INFRA_ERRORS as e:
                self._engine_failed(e)  # the batch's episodes stay as they were: retried at the next advance
            except ROLLOUT_ERRORS as e:
                for f, _ in batch:
                    f.error = e
        pending = [e.pending for f in self.flights for e in f.episodes if e.pending is not None]
        if pending and not ready:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        for f in self.flights:
            for e in f.episodes:
                if e.pending is not None and e.pending.done():
                    self._observe(f, e)
        ended = [f for f in self.flights if f.idle and (f.error is not None or f.done)]
        self.flights = [f for f in self.flights if f not in ended]  # eq=False: identity
        return [Finished(f.task, f.key, [] if f.error else self._trajectories(f), f.error) for f in ended]

    def _engine_failed(self, e: Exception) -> None:
        self.engine_failures += 1
        if self.engine_failures >= ENGINE_RETRIES:
            raise EngineError(f"generation failed {self.engine_failures} times in a row, last: "
                              f"{type(e).__name__}: {e}") from e
        backoff = min(ENGINE_BACKOFF_S * 2 ** (self.engine_failures - 1), 10.0)
        log.warning("generation failed (%s: %s): retrying in %.1f s (%d/%d)", type(e).__name__, e, backoff,
                    self.engine_failures, ENGINE_RETRIES)
        time.sleep(backoff)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------------------------- turns

    def _batches(self, ready: list[InFlight]) -> list[list[tuple[InFlight, Episode]]]:
        """The active episodes of the ready tasks, one batch per stop set (a tool task stops after a call)."""
        by_stop: dict[tuple[str, ...], list[tuple[InFlight, Episode]]] = {}
        for f in ready:
            for e in f.episodes:
                if e.final is not None:
                    continue
                if e.turns >= self.s.max_turns or self.limit - len(e.tokens) < 1:
                    e.final = e.env.step("")  # turn or context limit: the episode ends without an answer
                    continue
                by_stop.setdefault(tuple(e.env.stop), []).append((f, e))
        return list(by_stop.values())

    def _generate(self, batch: list[tuple[InFlight, Episode]]) -> None:
        f0, e0 = batch[0]
        room = self.limit - max(len(e.tokens) for _, e in batch)
        t0 = time.perf_counter()
        gens = self.engine.generate([e.tokens for _, e in batch], min(self.s.max_new_tokens, room),
                                    self.s.temperature, self.s.top_p, stop=[*e0.env.stop, *self.s.stop] or None,
                                    seed=f0.seed + e0.turns)
        dt, version = time.perf_counter() - t0, int(self.engine.version)
        for (_, e), g in zip(batch, gens):
            e.gen_seconds += dt
            e.turns += 1
            e.versions.append(version)
            e.tokens += g.token_ids
            e.mask += [1] * len(g.token_ids)
            # behaviour log-probs: the distribution actually sampled (the model's own at temperature 0)
            e.logprobs += list(g.sample_logprobs if self.s.temperature > 0 else g.logprobs)
            e.pending = self._env_step(e.env, g.text or self.tokenizer.decode(g.token_ids))

    def _env_step(self, env: Any, text: str) -> Future:
        alone = self.s.concurrency <= 1 and self.s.group_size <= 1
        if alone or not getattr(getattr(env, "latency", None), "sleep", True):  # nothing to overlap, or no wait
            fut: Future = Future()
            try:
                fut.set_result(env.step(text))
            except Exception as e:  # noqa: BLE001 - handed to the caller like a pool's future
                fut.set_exception(e)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.s.concurrency * self.s.group_size, thread_name_prefix="env")
        return self._pool.submit(env.step, text)

    def _observe(self, f: InFlight, e: Episode) -> None:
        fut, e.pending = e.pending, None
        err = fut.exception()
        if err is not None:  # the machine's fault (no memory, a file or socket): not the task's
            infra = isinstance(err, (MemoryError, OSError))
            f.error = err if infra or isinstance(err, ROLLOUT_ERRORS) else TaskError(
                f"environment raised {type(err).__name__}: {err}")
            return
        step = fut.result()
        if step.done:
            e.final = step
            return
        obs = self.tokenizer.encode(step.observation)
        e.tokens += obs
        e.mask += [0] * len(obs)
        e.logprobs += [0.0] * len(obs)

    def _trajectories(self, f: InFlight) -> list[Trajectory]:
        finished, n = time.time(), self.s.group_size
        out = []
        for i, e in enumerate(f.episodes):
            versions = sorted(set(e.versions)) or [int(self.engine.version)]
            t = f.task
            out.append(Trajectory(
                traj_id=f"{t.task_id}:{i}", task_id=t.task_id, family=t.family, concept=t.concept, phase=t.phase,
                group_id=t.task_id if n > 1 else "", group_size=n, prompt_len=f.prompt_len, tokens=e.tokens,
                loss_mask=e.mask, logprobs=e.logprobs, temperature=float(self.s.temperature),
                reward=float(e.final.reward),
                reward_parts={k: float(v) for k, v in e.final.parts.items()}, success=bool(e.final.success),
                policy_version=versions[0], policy_versions=versions, n_turns=e.turns,
                n_tool_calls=int(e.env.n_calls), agent_id=self.agent_id, created_at=t.created_at,
                started_at=f.started, finished_at=finished, gen_seconds=e.gen_seconds,
                env_seconds=float(e.env.env_seconds)))
        return out


def run_tasks(engine: Any, tokenizer: Any, tasks: list[Task], s: AgentSettings, agent_id: str = "",
              latency: Any = None) -> list[list[Trajectory]]:
    """Every task's trajectories (in the order given), with up to `s.concurrency` tasks in flight; the
    first task whose rollout raised raises here. The one batched episode loop of the project: the agents,
    the evaluator and the warm start's held-out evaluation run it. `latency`: see `Rollouts`."""
    r = Rollouts(engine, tokenizer, s, agent_id, latency)
    queue, out = list(enumerate(tasks)), {}
    try:
        while queue or len(r):
            while queue and len(r) < s.concurrency:
                i, task = queue.pop(0)
                r.start(task, key=i)
            for done in r.advance(timeout=None):
                if done.error is not None:
                    raise done.error
                out[done.key] = done.trajectories
    finally:
        r.close()
    return [out[i] for i in range(len(tasks))]


def rollout(engine: Any, tokenizer: Any, task: Task, s: AgentSettings, agent_id: str = "") -> list[Trajectory]:
    """`s.group_size` multi-turn episodes of one task, generated in one batch per turn by the same weights."""
    return run_tasks(engine, tokenizer, [task], s, agent_id)[0]

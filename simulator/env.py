"""The environment an agent talks to: `make_env(task).step(text)` until `done`.

Single-turn families are done after one step. The tool family is multi-turn: a step whose text
holds `<call>...</call>` gets an `<obs>...</obs>` observation (after the simulated tool latency, slept
here), any other text is the final answer; the markup is a setting (`Markup`). Everything is rebuilt
from the Task alone.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from simulator import tool_envs
from simulator.families import check_task_spec, family_of
from simulator.families.tools import episode_reward, observe
from simulator.latency import LatencyConfig, latency_from_dict, sample_latency
from simulator.text import clean_answer, to_text
from streamer.wire.schema import Task

CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE = "<call>", "</call>", "<obs>", "</obs>"


@dataclass(frozen=True)
class Markup:
    """How a tool call is written in the agent's text and how its observation is wrapped: the embedded model's
    single-token markup by default; a model of your own may use its chat format's (`AgentSettings.tool_call`,
    `AgentSettings.observation`)."""

    call_open: str = CALL_OPEN
    call_close: str = CALL_CLOSE
    obs_open: str = OBS_OPEN
    obs_close: str = OBS_CLOSE


@dataclass
class Step:
    observation: str
    done: bool
    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    success: bool = False
    latency_s: float = 0.0


class Env:
    """One episode of one task. `stop`: strings after which the agent hands its text to `step` (eos always stops)."""

    def __init__(self, task: Task, latency: LatencyConfig | None = None, markup: Markup = Markup()) -> None:
        self.task, self.markup = task, markup
        try:
            self.family = family_of(task)
            check_task_spec(task)
            self.latency = latency or latency_from_dict(task.spec.get("latency")) or LatencyConfig()
        except (ValueError, TypeError) as e:
            raise ValueError(f"task {task.task_id} ({task.family}): {e}") from None
        self.tools = task.spec.get("tools")  # a recorded row's tool environment (`simulator.tool_envs`)
        self.multi_turn = self.family.multi_turn or self.tools is not None
        self.stop: list[str] = [markup.call_close] if self.multi_turn else []
        self.done = False
        self.n_calls = 0
        self.n_errors = 0
        self.env_seconds = 0.0
        self._rng = random.Random(f"latency-{task.task_id}")

    def prompt(self) -> str:
        return self.task.prompt

    def messages(self) -> list[dict] | None:
        """A recorded chat's messages, for a model with a chat template (`prompt` holds them rendered as text)."""
        return self.task.spec.get("messages")

    def step(self, action_text: object) -> Step:
        if self.done:
            raise RuntimeError(f"task {self.task.task_id}: step() after the episode ended")
        text = to_text(action_text)
        if self.multi_turn and text is not None and self.markup.call_open in text:
            return self._tool_step(text)
        return self._final(action_text)

    def _final(self, answer: object) -> Step:
        self.done = True
        verdict = self.family.verify(self.task, answer)
        if not self.multi_turn:
            return Step("", True, verdict.reward, dict(verdict.parts), verdict.success)
        calls = {"tool_calls": float(self.n_calls), "tool_errors": float(self.n_errors)}
        if self.tools is not None:  # a recorded row's verifier scores the answer; its tools only help
            return Step("", True, verdict.reward, {**verdict.parts, **calls}, verdict.success)
        penalty = float(self.task.spec.get("error_penalty", 0.0))
        reward = episode_reward(verdict.success, self.n_errors, penalty)
        return Step("", True, reward, {**verdict.parts, **calls}, verdict.success)

    def _tool_step(self, text: str) -> Step:
        max_turns = int(self.tools.get("max_calls", tool_envs.MAX_CALLS) if self.tools is not None
                        else self.task.spec.get("max_turns", 3))
        if self.n_calls >= max_turns:
            self.done = True
            parts = {"correct": 0.0, "turn_limit": 1.0, "tool_calls": float(self.n_calls),
                     "tool_errors": float(self.n_errors)}
            return Step("", True, 0.0, parts, False)
        self.n_calls += 1
        obs, ok = self._call(text)
        self.n_errors += not ok
        delay = sample_latency(self.latency, self._rng)
        if self.latency.sleep and delay > 0:
            time.sleep(delay)
        self.env_seconds += delay
        return Step(f"{self.markup.obs_open}{obs}{self.markup.obs_close}", False, 0.0, {}, False, delay)

    def _call(self, text: str) -> tuple[str, bool]:
        start = text.rfind(self.markup.call_open) + len(self.markup.call_open)
        end = text.find(self.markup.call_close, start)
        inner = text[start:end] if end >= 0 else text[start:]
        if self.tools is not None:
            return tool_envs.call(self.tools, inner) if end >= 0 else (f"error: no {self.markup.call_close}", False)
        if end < 0 or len(inner) > 40 or clean_answer(inner.strip() or "x")[0] is None:
            return observe(self.task.spec, "")[0], False
        return observe(self.task.spec, inner)


def make_env(task: Task, latency: LatencyConfig | None = None, markup: Markup = Markup()) -> Env:
    return Env(task, latency, markup)

"""The environment: single-turn and multi-turn episodes, tool errors, turn limit, latency."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from simulator.env import Markup, make_env
from simulator.families import FAMILIES
from simulator.latency import TASK_MAX_S, LatencyConfig, sample_latency
from streamer.wire.schema import Task, decode, encode

NO_SLEEP = LatencyConfig(mean_s=0.0)


def _tool_task(concept: str = "find/key/1", **opts) -> Task:
    prompt, answer, spec = FAMILIES["tool"].sample(random.Random(5), concept, opts)
    return Task(task_id="tool-1", family="tool", concept=concept, prompt=prompt, answer=answer, spec=spec)


def test_single_turn_done_after_one_step():
    prompt, answer, spec = FAMILIES["string"].sample(random.Random(1), "sort", {})
    env = make_env(Task(task_id="s", family="string", concept="sort", prompt=prompt, answer=answer, spec=spec))
    assert env.prompt() == prompt and env.stop == []
    step = env.step(answer)
    assert (step.done, step.reward, step.success, step.observation) == (True, 1.0, True, "")
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(answer)


def test_tool_episode_follows_the_demonstration():
    task = _tool_task()
    demo = FAMILIES["tool"].demonstrate(task)  # <call>find(k=xxx)</call><obs>NN</obs>NN
    call, rest = demo.split("</call>", 1)
    env = make_env(task, NO_SLEEP)
    assert env.stop == ["</call>"]
    step = env.step(call + "</call>")
    assert not step.done and step.observation == f"<obs>{task.answer}</obs>" == rest[:len(step.observation)]
    final = env.step(task.answer)
    assert (final.done, final.reward, final.success) == (True, 1.0, True)
    assert final.parts["tool_calls"] == 1.0 and final.parts["tool_errors"] == 0.0


def test_the_tool_markup_is_a_setting():
    task = _tool_task()
    name = task.spec["name"]
    qwen = Markup("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    env = make_env(task, NO_SLEEP, qwen)
    assert env.stop == ["</tool_call>"]
    step = env.step(f"<tool_call>find(k={name})</tool_call>")
    assert not step.done and step.observation == f"<tool_response>{task.answer}</tool_response>"
    assert env.step(f"<call>find(k={name})</call>").done  # the embedded markup is now plain text: an answer


def test_renamed_tool_error_lists_the_available_tool_and_retry_recovers():
    task = _tool_task()  # the tool is now find(k=x)
    env = make_env(task, NO_SLEEP)
    name = task.spec["name"]
    obs = env.step(f"<call>look({name})</call>").observation
    assert obs == "<obs>error: tools: find(k=x)</obs>"
    obs = env.step(f"<call>find({name})</call>").observation  # old argument format
    assert obs == "<obs>error: use find(k=x)</obs>"
    assert env.step(f"<call>find(k={name})</call>").observation == f"<obs>{task.answer}</obs>"
    final = env.step(task.answer)
    # reward = 1 - error_penalty * errors = 1 - 0.25 * 2 = 0.5
    assert final.success and final.reward == pytest.approx(0.5) and final.parts["tool_errors"] == 2.0


def test_recovery_demonstration_matches_the_env():
    task = _tool_task("find/plain/0")
    demo = FAMILIES["tool"].demonstrate(task, wrong_tool="look")
    assert demo.startswith("<call>look(") and "<obs>error: tools: find(x)</obs>" in demo
    env = make_env(task, NO_SLEEP)
    text, step = demo, None
    while "</call>" in text:
        call, text = text.split("</call>", 1)
        step = env.step(call + "</call>")
        assert text.startswith(step.observation)
        text = text[len(step.observation):]
    assert env.step(text).reward == pytest.approx(0.75)


@pytest.mark.parametrize("bad", ["<call>", "<call>look(</call>", "<call>" + "x" * 10_000 + "</call>",
                                 "<call>find(k=<obs>1</obs>)</call>", "<call>find(k=zzzz)</call>",
                                 "<call>\udcff()</call>", b"<call>\xff\xfe</call>"])
def test_malformed_calls_get_error_observations(bad):
    env = make_env(_tool_task(), NO_SLEEP)
    step = env.step(bad)
    assert not step.done and step.observation.startswith("<obs>error:") and step.observation.endswith("</obs>")


def test_turn_limit_ends_the_episode_with_zero():
    task = _tool_task(max_turns=2)
    env = make_env(task, NO_SLEEP)
    call = f"<call>find(k={task.spec['name']})</call>"
    assert not env.step(call).done and not env.step(call).done
    last = env.step(call)
    assert (last.done, last.reward, last.parts["turn_limit"]) == (True, 0.0, 1.0)


def test_env_sleeps_its_latency():
    task = _tool_task()
    env = make_env(task, LatencyConfig(kind="const", mean_s=0.05))
    t = time.perf_counter()
    step = env.step(f"<call>find(k={task.spec['name']})</call>")
    assert step.latency_s == 0.05 and time.perf_counter() - t >= 0.05


def test_latency_from_the_task_spec_and_rebuilt_after_a_round_trip():
    task = _tool_task()
    task.spec["latency"] = {"kind": "const", "mean_s": 0.0, "sleep": False}
    env = make_env(decode(encode(task), Task))
    assert env.latency.mean_s == 0.0 and env.step(f"<call>find(k={task.spec['name']})</call>").latency_s == 0.0


def test_a_task_never_sets_a_latency_above_the_cap_nor_a_non_finite_one():
    """A replayed row with latency mean_s=1e6 made the environment sleep 1e6 s per call (issue 14, finding 6)."""
    task = _tool_task()
    task.spec["latency"] = {"kind": "const", "mean_s": 1e6, "max_s": 1e9, "sleep": False}
    env = make_env(decode(encode(task), Task))
    assert env.step(f"<call>find(k={task.spec['name']})</call>").latency_s == TASK_MAX_S == 30.0
    for bad, why in (({"mean_s": float("nan")}, r"latency.mean_s: nan is not a finite number"),
                     ({"max_s": float("inf")}, r"latency.max_s: inf is not a finite number"),
                     ({"mean_s": 1.0, "hours": 2}, r"latency: unknown field\(s\) \['hours'\]"),
                     ({"mean_s": "slow"}, r"task tool-1 \(tool\): ")):
        task.spec["latency"] = bad
        with pytest.raises(ValueError, match=why):
            make_env(task)


@pytest.mark.parametrize("kind", ["exp", "lognormal", "pareto"])
def test_latency_distributions_have_the_configured_mean(kind):
    cfg = LatencyConfig(kind=kind, mean_s=0.01, sigma=1.0, alpha=2.5, max_s=1e9)
    rng = random.Random(0)
    xs = [sample_latency(cfg, rng) for _ in range(40_000)]
    # every kind is parametrised to mean 0.01; the sample mean is within 5% (40k draws; pareto 2.5 has finite variance)
    assert statistics.fmean(xs) == pytest.approx(0.01, rel=0.05)
    assert max(xs) > 5 * 0.01  # long-tailed: some calls take many times the mean


def test_a_task_with_a_broken_spec_is_refused_with_the_field():
    task = _tool_task()
    task.spec.pop("world")
    with pytest.raises(ValueError, match=r"task tool-1 \(tool\): spec.world: missing"):
        make_env(task)
    with pytest.raises(ValueError, match="unknown family 'chess'"):
        make_env(Task(task_id="c", family="chess", concept="x", prompt="p", answer="a"))

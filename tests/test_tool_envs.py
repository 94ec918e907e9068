"""Tool environments of recorded streams (`simulator.tool_envs`): built-ins, user entry points, an episode."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from simulator import tool_envs
from simulator.env import make_env
from simulator.latency import LatencyConfig
from simulator.records import RowError, message_from_row
from simulator.tool_envs import ToolError

NO_SLEEP = LatencyConfig(mean_s=0.0)
TABLE = {"acme": "42", "globex": "7"}


@pytest.mark.parametrize("call, expected", [
    ("calc(2*(3+4)-1)", ("13", True)), ("calc(7/2)", ("3.5", True)), ("calc(-3 + 1.25)", ("-1.75", True)),
    ("calc(1/0)", ("error: cannot compute: ZeroDivisionError", False)),
    ("calc(__import__('os'))", ("error: only numbers, + - * / and parentheses", False)),
    ("calc(2**100)", ("error: only numbers, + - * / and parentheses", False)),
    ("sum(1,2)", ("error: use calc(...)", False)),
])
def test_calculator(call, expected):
    assert tool_envs.call({"env": "calculator"}, call) == expected


def test_lookup():
    tools = {"env": "lookup", "params": {"table": TABLE}}
    assert tool_envs.call(tools, "get(acme)") == ("42", True)
    assert tool_envs.call(tools, " get( globex ) ") == ("7", True)
    assert tool_envs.call(tools, "get(initech)") == ("error: no entry 'initech'", False)


def row(**tools) -> dict:
    return {"prompt": "price of acme? call get(name)", "reference": "42", "verifier": "numeric",
            "tags": {"source": "prices"}, "tools": {"env": "lookup", "params": {"table": TABLE}, **tools}}


def test_an_episode_with_a_recorded_rows_tool():
    task = message_from_row(row(max_calls=2))
    env = make_env(task, NO_SLEEP)
    assert env.stop == ["</call>"]
    first = env.step("<call>get(initech)</call>")
    assert (first.done, first.observation) == (False, "<obs>error: no entry 'initech'</obs>")
    assert env.step("<call>get(acme)</call>").observation == "<obs>42</obs>"
    final = env.step("it costs 42")
    assert (final.done, final.reward, final.success) == (True, 1.0, True)
    assert (final.parts["tool_calls"], final.parts["tool_errors"]) == (2.0, 1.0)
    env = make_env(task, NO_SLEEP)
    env.step("<call>get(acme)</call>"), env.step("<call>get(acme)</call>")
    over = env.step("<call>get(acme)</call>")  # max_calls=2: the third call ends the episode
    assert (over.done, over.reward, over.parts["turn_limit"]) == (True, 0.0, 1.0)
    plain = make_env(message_from_row({k: v for k, v in row().items() if k != "tools"}), NO_SLEEP)
    assert plain.stop == [] and plain.step("<call>get(acme)</call>").done  # no tools: the text is the answer


@pytest.mark.parametrize("tools, field, message", [
    (["lookup"], "tools", "tools: expected {env, params, max_calls}, got list"),
    ({"env": "search"}, "tools.env", "tool environment 'search': unknown"),
    ({"env": "lookup"}, "tools.params", "lookup needs a table"),
    ({"env": "calculator", "max_calls": 0}, "tools.max_calls", "an integer in 1..16, got 0"),
    ({"env": "calculator", "timeout": 3}, "tools", "unknown key(s) ['timeout']"),
])
def test_a_bad_tools_field_is_named(tools, field, message):
    with pytest.raises(RowError) as e:
        message_from_row({**row(), "tools": tools})
    assert e.value.field == field and message in str(e.value)


def shout(call: str, params: dict) -> str:
    if not call:
        raise ToolError("say something")
    return call.upper() + params.get("suffix", "")


def broken(call: str, params: dict) -> str:
    raise KeyError("bug")


def test_user_tool_environments_come_from_named_entry_points(monkeypatch):
    points = [EntryPoint(name="shout", value="test_tool_envs:shout", group=tool_envs.GROUP),
              EntryPoint(name="broken", value="test_tool_envs:broken", group=tool_envs.GROUP)]
    monkeypatch.setattr(tool_envs.REGISTRY, "entry_points", lambda: points)
    monkeypatch.setattr(tool_envs.REGISTRY, "enabled", {})
    with pytest.raises(RowError, match="tool environment 'shout': unknown"):  # installed, not enabled
        message_from_row({**row(), "tools": {"env": "shout"}})
    tool_envs.enable(["shout", "broken"])
    task = message_from_row({**row(), "tools": {"env": "shout", "params": {"suffix": "!"}}})
    env = make_env(task, NO_SLEEP)
    assert env.step("<call>hey</call>").observation == "<obs>HEY!</obs>"
    assert env.step("<call></call>").observation == "<obs>error: say something</obs>"
    assert tool_envs.call({"env": "broken"}, "x") == ("error: the tool failed", False)

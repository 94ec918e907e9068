"""Tool environments of recorded task streams: what a tool call in an agent's answer returns.

A production row's `tools` names one environment: `{"env": "lookup", "params": {...}, "max_calls": 3}`. The agent
calls it as `<call>name(argument)</call>` (the markup is `agent.tool_call`) and gets the observation back wrapped
(`agent.observation`); any other text is its final answer, scored by the row's verifier. Built in:
- `lookup`: `get(key)` returns `params.table[key]`;
- `calculator`: `calc(expression)` returns the value of +, -, *, / and parentheses over numbers.
A user environment is a function `f(call: str, params: dict) -> str` (the text between the markup, the row's
params) published under the entry-point group `sao_lab.tools` and enabled by name (`agent.tool_envs`, `sao replay
--tool-env NAME`). It raises `ToolError(message)` for a call it refuses: the agent sees `error: message` and the call
counts as a tool error (`tool_errors` in the reward parts). Any other exception is the environment's bug: the call is
refused the same way and logged.
"""

from __future__ import annotations

import ast
import logging
import operator
import re
from typing import Any

from simulator.plugins import PluginError, Registry

log = logging.getLogger("simulator.tool_envs")

GROUP = "sao_lab.tools"
MAX_CALLS = 3  # default tool calls per episode
_CALL = re.compile(r"\s*(\w+)\((.*)\)\s*", re.DOTALL)


class ToolError(ValueError):
    """A call the environment refuses; its message is what the agent sees."""


def parse_call(call: str, name: str) -> str:
    """The argument of `name(argument)`, or ToolError naming the expected form."""
    m = _CALL.fullmatch(call)
    if m is None or m.group(1) != name:
        raise ToolError(f"use {name}(...)")
    return m.group(2).strip()


def lookup(call: str, params: dict[str, Any]) -> str:
    key = parse_call(call, "get")
    table = params.get("table", {})
    if key not in table:
        raise ToolError(f"no entry {key!r}")
    return str(table[key])


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ToolError("only numbers, + - * / and parentheses")


def calculator(call: str, params: dict[str, Any]) -> str:
    expression = parse_call(call, "calc")
    if len(expression) > 200:
        raise ToolError("expression over 200 characters")
    try:
        value = _value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ToolError(f"cannot compute: {type(e).__name__}") from None
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


BUILTIN = {"lookup": lookup, "calculator": calculator}
REGISTRY = Registry("tool environment", GROUP, "tools.env", BUILTIN)
enable, known = REGISTRY.enable, REGISTRY.known


def check(tools: object) -> None:
    """Raise PluginError naming what is wrong with a row's `tools`."""
    if not isinstance(tools, dict):
        raise PluginError("tools", f"tools: expected {{env, params, max_calls}}, got {type(tools).__name__}")
    extra = set(tools) - {"env", "params", "max_calls"}
    if extra:
        raise PluginError("tools", f"tools: unknown key(s) {sorted(extra)} (env, params, max_calls)")
    REGISTRY.check_name(tools.get("env"))
    if not isinstance(tools.get("params", {}), dict):
        raise PluginError("tools.params", "tools.params: expected an object")
    if tools.get("env") == "lookup" and not isinstance(tools.get("params", {}).get("table"), dict):
        raise PluginError("tools.params", "tools.params: lookup needs a table {key: value}")
    calls = tools.get("max_calls", MAX_CALLS)
    if not isinstance(calls, int) or isinstance(calls, bool) or not 1 <= calls <= 16:
        raise PluginError("tools.max_calls", f"tools.max_calls: expected an integer in 1..16, got {calls!r}")


def call(tools: dict[str, Any], text: str) -> tuple[str, bool]:
    """The observation of one call and whether the environment accepted it."""
    fn = REGISTRY.get(tools["env"])
    try:
        return str(fn(text, tools.get("params", {}))), True
    except ToolError as e:
        return f"error: {e}", False
    except Exception as e:  # a user environment's bug: the call is refused, the episode goes on
        log.warning("tool environment %s raised %r", tools["env"], e)
        return "error: the tool failed", False

"""Rows of a task-stream file <-> messages, and the validation every replayed row goes through.

One row per message. JSONL: the message's fields plus `"kind": "task"|"drift"` (rows without a kind
are tasks). Tabular files (Parquet, CSV) have the columns of TABLE_COLUMNS; `spec` and a drift
event's body (`event`) are JSON text there.

A recorded production stream uses the open row format instead (a row with a `verifier` key, PRODUCTION_FIELDS):
`prompt` (or `messages`, a chat as [{role, content}]), `reference`, `verifier` and its `params`
(`simulator.verifiers`), `tags` (`source` becomes the task's family and `concept` its concept, so runs are analysed
per tag as simulated ones per family), `time` (seconds; optional), `task_id` (optional: a hash of the row's
content), `demonstration` (optional: an answer written for it, for a supervised warm start, `learner.finetune`) and
`tools` (optional: the tool environment the agent may call, `simulator.tool_envs`). In CSV and Parquet,
`messages`, `params`, `tags` and `tools` are JSON text.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from simulator import tool_envs, verifiers
from simulator.families import FAMILIES, check_task_spec
from simulator.plugins import PluginError
from simulator.text import ALPHABET, in_alphabet
from streamer.wire.schema import DriftEvent, SchemaError, Task, from_dict, to_dict

TASK_FIELDS = ("v", "task_id", "family", "concept", "phase", "prompt", "answer", "spec", "seq", "created_at")
TABLE_COLUMNS = ("kind",) + TASK_FIELDS + ("event",)
MAX_PROMPT_CHARS = 200
ALPHABET_SYMBOLS = "".join(c for c in ALPHABET if not c.isalnum())
TAG_WINDOW = 64  # rows within which tag changes of several sources are one drift event (TagDrift)
PRODUCTION_FIELDS = ("task_id", "prompt", "messages", "reference", "verifier", "params", "tags", "time", "tools",
                     "demonstration")


@dataclass(frozen=True)
class PromptRule:
    """Which prompts the served model can take. Without a tokenizer: the embedded character model's (its alphabet,
    at most MAX_PROMPT_CHARS characters); with one (`prompt_rule(model_dir, load_tokenizer)`): any text whose
    prompt, chat template applied, leaves at least `reserve` tokens of the model's context `context` for the
    answer."""

    tokenizer: Any = None
    context: int = 0
    reserve: int = 64

    def check(self, task: Task) -> None:
        if not task.prompt:
            raise RowError("prompt", "empty")
        if self.tokenizer is None:
            if len(task.prompt) > MAX_PROMPT_CHARS or not in_alphabet(task.prompt):
                raise RowError("prompt", f"over {MAX_PROMPT_CHARS} characters or outside the embedded model's "
                                         f"alphabet (lowercase letters, digits and {ALPHABET_SYMBOLS!r}); "
                                         f"serve your own model (--model DIR) for any text")
            return
        n = len(self.tokenizer.encode_prompt(task.prompt, task.spec.get("messages")))
        if n > self.context - self.reserve:
            raise RowError("prompt", f"{n} tokens: over the model's context of {self.context} less "
                                     f"{self.reserve} for the answer")


EMBEDDED = PromptRule()


def prompt_rule(model_dir: str | Path | None,
                load_tokenizer: Callable[[str | Path], Any] | None = None) -> PromptRule:
    """The rule for the model in `model_dir` (the embedded model's when it holds the character tokenizer).
    `load_tokenizer(model_dir)` reads its own tokenizer (the caller's: `learner.models.tokenizer.load_tokenizer`;
    the simulator does not import the learner)."""
    if not model_dir or (Path(model_dir) / "sao_tokenizer.json").is_file():
        return EMBEDDED
    if load_tokenizer is None:
        raise ValueError(f"{model_dir}: checking prompts against a model's own tokenizer needs load_tokenizer")
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(str(model_dir)), "max_position_embeddings", None) or 1 << 30
    return PromptRule(load_tokenizer(model_dir), int(context))


class RowError(ValueError):
    """A row that is not a valid message; `field` names the culprit."""

    def __init__(self, field: str, msg: str) -> None:
        super().__init__(f"field '{field}': {msg}")
        self.field = field


def task_row(task: Task) -> dict[str, Any]:
    return {"kind": "task", **to_dict(task)}


def drift_row(event: DriftEvent) -> dict[str, Any]:
    return {"kind": "drift", **to_dict(event)}


def table_row(msg: Task | DriftEvent) -> dict[str, Any]:
    """A flat row with every TABLE_COLUMNS key (empty values where the kind has no such field)."""
    if isinstance(msg, DriftEvent):
        row = dict.fromkeys(TASK_FIELDS, None)
        row.update(kind="drift", v=msg.v, event=json.dumps(to_dict(msg)), created_at=msg.time)
        return row
    row = {"kind": "task", **to_dict(msg), "event": None}
    row["spec"] = json.dumps(row["spec"], separators=(",", ":"))
    return row


def _schema_field(e: Exception) -> str:
    text = str(e)
    m = re.search(r"missing required field `([^`]+)`", text)
    if m:
        return m.group(1)
    return text.rsplit("$.", 1)[1].rstrip("`") if "$." in text else "?"


def message_from_row(row: dict[str, Any], tabular: bool = False, rule: PromptRule = EMBEDDED) -> Task | DriftEvent:
    """Decode and validate one row (its prompt against `rule`); raises RowError naming the field."""
    kind = row.get("kind") or "task"
    if kind == "drift":
        body = row.get("event") if tabular else {k: v for k, v in row.items() if k != "kind"}
        if tabular:
            try:
                body = json.loads(body)
            except (TypeError, ValueError) as e:
                raise RowError("event", f"not JSON: {e}") from None
        try:
            return from_dict(body, DriftEvent)
        except SchemaError as e:
            raise RowError(_schema_field(e), str(e)) from None
    if kind != "task":
        raise RowError("kind", f"expected 'task' or 'drift', got {kind!r}")
    if "verifier" in row:
        task = production_task(row)
        check_task(task, rule)
        return task
    data = {k: row[k] for k in TASK_FIELDS if k in row and row[k] is not None}
    if tabular and isinstance(data.get("spec"), str):
        try:
            data["spec"] = json.loads(data["spec"])
        except ValueError as e:
            raise RowError("spec", f"not JSON: {e}") from None
    try:
        task = from_dict(data, Task)
    except SchemaError as e:
        raise RowError(_schema_field(e), str(e)) from None
    check_task(task, rule)
    return task


def _json_cell(row: dict[str, Any], key: str, default: Any) -> Any:
    value = row.get(key)
    if value is None:
        return default
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise RowError(key, f"not JSON: {e}") from None
    return value


def render_chat(messages: object) -> str:
    """A chat as plain text, one `role: content` line per message, for a model without a chat template (the
    embedded character model)."""
    if not isinstance(messages, list) or not messages:
        raise RowError("messages", "expected a non-empty list of {role, content}")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(f"messages[{i}]", "expected {role: str, content: str}")
        lines.append(f"{m['role']}: {m['content']}")
    return "\n".join(lines)


def production_task(row: dict[str, Any]) -> Task:
    """A Task from a row of the open production format (see the module docstring); raises RowError."""
    unknown = sorted(set(row) - set(PRODUCTION_FIELDS) - {"kind"})
    if unknown:
        raise RowError(unknown[0], f"unknown field (a production row has {', '.join(PRODUCTION_FIELDS)})")
    has_prompt, has_chat = row.get("prompt") is not None, row.get("messages") is not None
    if has_prompt == has_chat:
        raise RowError("prompt", "give exactly one of prompt, messages")
    messages = None if has_prompt else _json_cell(row, "messages", None)
    prompt = row["prompt"] if has_prompt else render_chat(messages)
    if not isinstance(prompt, str):
        raise RowError("prompt", f"expected text, got {type(prompt).__name__}")
    if row.get("reference") is None:
        raise RowError("reference", "missing")
    if row.get("demonstration") is not None and not isinstance(row["demonstration"], str):
        raise RowError("demonstration", f"expected text, got {type(row['demonstration']).__name__}")
    params, tags = _json_cell(row, "params", {}), _json_cell(row, "tags", {})
    tools = _json_cell(row, "tools", None)
    try:
        verifiers.check(row["verifier"], params, str(row["reference"]))
        if tools is not None:
            tool_envs.check(tools)
    except PluginError as e:
        raise RowError(e.field, str(e)) from None
    if not isinstance(tags, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items()):
        raise RowError("tags", "expected an object of text values")
    try:
        when = float(row.get("time") if row.get("time") is not None else 0.0)
    except (TypeError, ValueError):
        raise RowError("time", f"expected a number, got {row.get('time')!r}") from None
    task_id = row.get("task_id") or "t-" + hashlib.sha256(
        json.dumps([prompt, str(row["reference"]), when], ensure_ascii=False).encode()).hexdigest()[:16]
    return Task(task_id=str(task_id), family=tags.get("source", "stream"), concept=tags.get("concept", "default"),
                prompt=prompt, answer=str(row["reference"]), created_at=when,
                spec={"verifier": row["verifier"], "params": params, "tags": tags,
                      **({"messages": messages} if messages else {}), **({"tools": tools} if tools else {})})


class TagDrift:
    """Drift of a recorded production stream, read from its tags: a row whose `concept` tag differs from the last one
    of its `source` tag starts a new phase, announced by a DriftEvent before it (abrupt), as the simulator announces
    a scenario's phases. Changes of other sources within the next `merge_rows` rows join the same event (a stream
    often changes several sources at once; one phase per change would leave each a block of a few rows), so rows
    are held back until that window has passed. Tasks get their phase and stream position (`seq`): recovery after a
    tag change is measured exactly as after a simulated drift (`streamer.runs.recovery`)."""

    def __init__(self, merge_rows: int = TAG_WINDOW) -> None:
        self.merge_rows = merge_rows
        self.phase, self.seq = 0, 0
        self.concepts: dict[str, str] = {}  # source -> its latest concept
        self.pending: DriftEvent | None = None  # announced once its merge window has passed
        self.held: list[Task] = []

    def push(self, task: Task) -> list[Task | DriftEvent]:
        """The messages ready to send, in order, once `task` is in."""
        out = self.flush() if self.pending is not None and self.seq > self.pending.at_seq + self.merge_rows else []
        prev = self.concepts.get(task.family)
        if prev is not None and prev != task.concept:
            if self.pending is not None and self.pending.prev_concepts.get(task.family) == prev:
                self.pending.name += f"+{task.family}:{task.concept}"  # merged into the open event
            else:
                out += self.flush()
                self.phase += 1
                self.pending = DriftEvent(phase=self.phase, prev_phase=self.phase - 1,
                                          name=f"{task.family}:{task.concept}", schedule="abrupt", families=[],
                                          concepts={}, prev_concepts=dict(self.concepts), at_seq=self.seq,
                                          time=task.created_at)
        self.concepts[task.family] = task.concept
        if self.pending is not None:
            self.pending.concepts, self.pending.families = dict(self.concepts), sorted(self.concepts)
        task.phase, task.seq = self.phase, self.seq
        self.seq += 1
        (self.held if self.pending is not None else out).append(task)
        return out

    def flush(self) -> list[Task | DriftEvent]:
        """The open event and the rows held behind it (at the end of the stream, or when its window has passed)."""
        out: list[Task | DriftEvent] = [self.pending, *self.held] if self.pending is not None else []
        self.pending, self.held = None, []
        return out


def check_task(task: Task, rule: PromptRule = EMBEDDED) -> None:
    """What the schema cannot say: a known family, a valid spec, a prompt the model can take, a timestamp."""
    if task.family not in FAMILIES and "verifier" not in task.spec:
        raise RowError("family", f"unknown family '{task.family}' (known: {', '.join(FAMILIES)}; a recorded "
                                 f"stream's rows name a verifier instead)")
    try:
        check_task_spec(task)
    except ValueError as e:
        raise RowError(str(e).split(":")[0], str(e)) from None
    if not task.task_id:
        raise RowError("task_id", "empty")
    rule.check(task)
    if not math.isfinite(task.created_at) or task.created_at < 0:
        raise RowError("created_at", f"not a finite time >= 0: {task.created_at}")


_json_decoder = msgspec.json.Decoder()


def parse_json_line(line: bytes) -> dict[str, Any]:
    try:
        data = _json_decoder.decode(line)
    except msgspec.DecodeError as e:
        raise RowError("<line>", f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise RowError("<line>", f"expected a JSON object, got {type(data).__name__}")
    return data

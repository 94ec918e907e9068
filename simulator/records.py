"""Rows of a task-stream file <-> messages, and the validation every replayed row goes through.

One row per message. JSONL: the message's fields plus `"kind": "task"|"drift"` (rows without a kind
are tasks). Tabular files (Parquet, CSV) have the columns of TABLE_COLUMNS; `spec` and a drift
event's body (`event`) are JSON text there.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from simulator.families import FAMILIES
from simulator.text import in_alphabet
from streamer.wire.schema import DriftEvent, SchemaError, Task, from_dict, to_dict

TASK_FIELDS = ("v", "task_id", "family", "concept", "phase", "prompt", "answer", "spec", "seq", "created_at")
TABLE_COLUMNS = ("kind",) + TASK_FIELDS + ("event",)
MAX_PROMPT_CHARS = 200


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


def message_from_row(row: dict[str, Any], tabular: bool = False) -> Task | DriftEvent:
    """Decode and validate one row; raises RowError naming the field."""
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
    check_task(task)
    return task


def check_task(task: Task) -> None:
    """What the schema cannot say: a known family, a valid spec, a usable prompt and timestamp."""
    family = FAMILIES.get(task.family)
    if family is None:
        raise RowError("family", f"unknown family '{task.family}' (known: {', '.join(FAMILIES)})")
    try:
        family.check_spec(task.spec)
    except ValueError as e:
        raise RowError(str(e).split(":")[0], str(e)) from None
    if not task.task_id:
        raise RowError("task_id", "empty")
    if not task.prompt or len(task.prompt) > MAX_PROMPT_CHARS or not in_alphabet(task.prompt):
        raise RowError("prompt", "empty, too long or outside the tokenizer alphabet")
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

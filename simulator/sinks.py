"""Where a task stream goes: the `TaskSink` protocol and its file and in-memory implementations.

The Kafka sink lives in `streamer` (it needs the Kafka clients); it implements the same three methods.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from simulator.records import TABLE_COLUMNS, drift_row, table_row, task_row
from streamer.wire.schema import DriftEvent, Task


@runtime_checkable
class TaskSink(Protocol):
    def write(self, task: Task) -> None: ...

    def write_drift(self, event: DriftEvent) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line (`kind` says task or drift)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "wb", buffering=1 << 20)
        self._enc = msgspec.json.Encoder()

    def write(self, task: Task) -> None:
        self._f.write(self._enc.encode(task_row(task)) + b"\n")

    def write_drift(self, event: DriftEvent) -> None:
        self._f.write(self._enc.encode(drift_row(event)) + b"\n")

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class ParquetSink:
    """Rows of TABLE_COLUMNS, buffered into row groups of `row_group` rows (bounded memory)."""

    def __init__(self, path: str | Path, row_group: int = 10_000) -> None:
        import pyarrow as pa

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        types = {"v": pa.int64(), "phase": pa.int64(), "seq": pa.int64(), "created_at": pa.float64()}
        self.schema = pa.schema([(c, types.get(c, pa.string())) for c in TABLE_COLUMNS])
        self.row_group = row_group
        self._rows: list[dict] = []
        self._writer = None

    def write(self, task: Task) -> None:
        self._add(table_row(task))

    def write_drift(self, event: DriftEvent) -> None:
        self._add(table_row(event))

    def _add(self, row: dict) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.row_group:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, self.schema)
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self.schema))
            self._rows = []

    def close(self) -> None:
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CsvSink:
    """Rows of TABLE_COLUMNS as CSV (pandas reads it back in chunks)."""

    def __init__(self, path: str | Path) -> None:
        import csv

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", newline="", buffering=1 << 20)
        self._w = csv.DictWriter(self._f, fieldnames=TABLE_COLUMNS)
        self._w.writeheader()

    def write(self, task: Task) -> None:
        self._w.writerow(table_row(task))

    def write_drift(self, event: DriftEvent) -> None:
        self._w.writerow(table_row(event))

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


class QueueSink:
    """An in-memory queue of messages; `close()` puts None, so a consumer knows the stream ended."""

    def __init__(self, maxsize: int = 0) -> None:
        self.queue: queue.Queue[Task | DriftEvent | None] = queue.Queue(maxsize)

    def write(self, task: Task) -> None:
        self.queue.put(task)

    def write_drift(self, event: DriftEvent) -> None:
        self.queue.put(event)

    def close(self) -> None:
        self.queue.put(None)

    def drain(self) -> list[Task | DriftEvent]:
        """Everything queued so far, up to the end marker."""
        out = []
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is None:
                break
            out.append(item)
        return out


def file_sink(path: str | Path) -> TaskSink:
    """A file sink chosen by the extension: .jsonl (or .json), .parquet, .csv."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return JsonlSink(path)
    if suffix in (".parquet", ".pq"):
        return ParquetSink(path)
    if suffix == ".csv":
        return CsvSink(path)
    raise ValueError(f"{path}: unknown task-stream format '{suffix}' (use .jsonl, .parquet or .csv)")

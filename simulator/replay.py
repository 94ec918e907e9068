"""`sao replay FILE`: publish a recorded task stream with its inter-arrival times scaled by `--speed`.

Reads JSONL and CSV line by line and Parquet in record batches, so memory stays bounded whatever the
file's size. Every row is validated (schema, family, spec, prompt, a time no more than `--max-gap`
recorded seconds after the previous row's, so one bad stamp cannot put the replay to sleep for months);
a bad row stops the replay with its row number and field, or with `--skip-bad` goes to a side
file (`FILE.rejects.jsonl`) and is counted. Row numbers are 1-based: JSONL lines, data rows of
a CSV (header excluded) or of a Parquet file. Rows are the project's messages or, for a recorded production
stream, the open row format of `simulator.records` (prompt or chat, reference, verifier and parameters, tags, time);
there a change of a source's `concept` tag is a drift, announced like a simulated one (`simulator.records.TagDrift`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import resource
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from simulator import tool_envs, verifiers
from simulator.records import (
    EMBEDDED,
    TAG_WINDOW,
    PromptRule,
    RowError,
    TagDrift,
    message_from_row,
    parse_json_line,
    prompt_rule,
)
from simulator.sinks import TaskSink, file_sink
from streamer.wire.schema import DriftEvent, Task

INT_COLUMNS = ("v", "phase", "seq")
MAX_GAP_S = 3600.0  # default bound on the recorded time between two consecutive rows
_MISSING = object()  # a CSV row with fewer cells than the header


class ReplayError(ValueError):
    pass


@dataclasses.dataclass
class ReplayStats:
    rows: int = 0
    tasks: int = 0
    drift_events: int = 0
    bad: int = 0
    bad_rows: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    max_lag_s: float = 0.0  # how far behind the scaled schedule a message was sent, at worst
    tasks_per_s: float = 0.0
    peak_rss_mb: float = 0.0


def _coerce_csv(row: dict[str, Any]) -> dict[str, Any]:
    if None in row:  # csv.DictReader's key for cells past the header's
        raise RowError("<row>", f"{len(row[None])} more cell(s) than the header's columns")
    short = [k for k, v in row.items() if v is _MISSING]
    if short:
        raise RowError("<row>", f"fewer cells than the header's columns (no {', '.join(short)})")
    out = {k: (None if v == "" else v) for k, v in row.items()}
    for k in INT_COLUMNS:
        if out.get(k) is not None:
            try:
                out[k] = int(out[k])
            except ValueError:
                raise RowError(k, f"expected an integer, got {out[k]!r}") from None
    if out.get("created_at") is not None:
        try:
            out["created_at"] = float(out["created_at"])
        except ValueError:
            raise RowError("created_at", f"expected a number, got {out['created_at']!r}") from None
    return out


def read_rows(path: Path, chunk_rows: int = 10_000) -> Iterator[tuple[int, Any, str]]:
    """(row number, raw row, format) for every row of the file; rows are decoded by `decode_row`."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield n, line, "jsonl"
    elif suffix == ".csv":
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            reader = csv.DictReader(f, restval=_MISSING)
            n = 0
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as e:  # e.g. a cell over csv.field_size_limit(): that row alone is bad
                    row = {None: [f"unreadable: {e}"]}
                n += 1
                yield n, row, "csv"
    elif suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows):
            for row in batch.to_pylist():
                n += 1
                yield n, row, "parquet"
    else:
        raise ReplayError(f"{path}: unknown format '{suffix}' (use .jsonl, .parquet or .csv)")


def row_dict(raw: Any, fmt: str) -> dict[str, Any]:
    """A row as `read_rows` gives it, as a dict of its fields (raises RowError for a line that is not JSON)."""
    if fmt == "jsonl":
        return parse_json_line(raw)
    return _coerce_csv(raw) if fmt == "csv" else raw


def decode_row(raw: Any, fmt: str, rule: PromptRule = EMBEDDED) -> Task | DriftEvent:
    return message_from_row(row_dict(raw, fmt), tabular=fmt != "jsonl", rule=rule)


def _raw_text(raw: Any) -> str:
    if isinstance(raw, bytes):
        return raw.decode("utf-8", errors="replace").rstrip("\n")
    return json.dumps(raw, default=str)


class _Pacer:
    """Waits so that message i leaves at start + (t_i - t_0) / speed; records the worst lag."""

    def __init__(self, speed: float, max_gap_s: float = MAX_GAP_S) -> None:
        self.speed, self.first, self.start, self.max_lag = speed, None, 0.0, 0.0
        self.max_gap_s, self.last = max_gap_s, None

    def check(self, stamp: float, field: str) -> None:
        """A time the replay can wait for: finite, >= 0, at most max_gap_s after the previous row's."""
        if not (stamp >= 0 and stamp != float("inf")):
            raise RowError(field, f"not a finite time >= 0: {stamp}")
        if self.last is not None and stamp - self.last > self.max_gap_s:
            raise RowError(field, f"{stamp} is {stamp - self.last:.0f} s after the previous row's time "
                                  f"(more than --max-gap {self.max_gap_s:g} s)")
        self.last = stamp if self.last is None else max(self.last, stamp)

    def wait(self, stamp: float) -> None:
        if self.speed <= 0:
            return
        if self.first is None:
            self.first, self.start = stamp, time.monotonic()
            return
        delay = self.start + (stamp - self.first) / self.speed - time.monotonic()
        if delay > 0.0005:
            time.sleep(delay)
        elif delay < 0:
            self.max_lag = max(self.max_lag, -delay)


def replay(path: str | Path, sink: TaskSink, speed: float = 1.0, skip_bad: bool = False,
           rejects: str | Path | None = None, restamp: bool = False, limit: int | None = None,
           chunk_rows: int = 10_000, max_gap_s: float = MAX_GAP_S, rule: PromptRule = EMBEDDED,
           tag_window: int = TAG_WINDOW) -> ReplayStats:
    """Publish the file's messages to `sink` in order (closing it). `restamp`: created_at = send time. `rule`:
    which prompts the served model takes (`simulator.records.prompt_rule`). `tag_window`: rows within which tag
    changes of a production stream join one drift event (`simulator.records.TagDrift`)."""
    path = Path(path)
    stats, pacer, t = ReplayStats(), _Pacer(speed, max_gap_s), time.perf_counter()
    rej_path = Path(rejects) if rejects else path.with_name(path.name + ".rejects.jsonl")
    rej, tags = None, TagDrift(tag_window)
    try:
        for n, raw, fmt in read_rows(path, chunk_rows):
            if limit is not None and stats.tasks + len(tags.held) >= limit:
                break
            stats.rows += 1
            try:
                msg = decode_row(raw, fmt, rule)
                pacer.check(*((msg.time, "time") if isinstance(msg, DriftEvent) else (msg.created_at, "created_at")))
            except RowError as e:
                if not skip_bad:
                    raise ReplayError(f"{path}: row {n}: {e}") from None
                rej = rej or open(rej_path, "w")
                rej.write(json.dumps({"row": n, "field": e.field, "error": str(e), "raw": _raw_text(raw)}) + "\n")
                stats.bad += 1
                stats.bad_rows.append(n)
                continue
            for ready in tags.push(msg) if isinstance(msg, Task) and "verifier" in msg.spec else [msg]:
                _send(ready, sink, pacer, restamp, stats)
        for ready in tags.flush():
            _send(ready, sink, pacer, restamp, stats)
    finally:
        sink.close()
        if rej is not None:
            rej.close()
    stats.seconds = time.perf_counter() - t
    stats.max_lag_s = pacer.max_lag
    stats.tasks_per_s = stats.tasks / stats.seconds if stats.seconds > 0 else 0.0
    stats.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return stats


def _send(msg: Task | DriftEvent, sink: TaskSink, pacer: _Pacer, restamp: bool, stats: ReplayStats) -> None:
    if isinstance(msg, DriftEvent):
        pacer.wait(msg.time)
        sink.write_drift(msg)
        stats.drift_events += 1
        return
    pacer.wait(msg.created_at)
    if restamp:
        msg.created_at = time.time()
    sink.write(msg)
    stats.tasks += 1


def add_plugin_args(p: argparse.ArgumentParser) -> None:
    """--verifier NAME, --tool-env NAME: the user plugins the rows may name (`enable_plugins`)."""
    p.add_argument("--verifier", action="append", default=[], metavar="NAME",
                   help="enable a user verifier (entry point NAME in group sao_lab.verifiers) that rows may name")
    p.add_argument("--tool-env", action="append", default=[], metavar="NAME",
                   help="enable a user tool environment (entry point NAME in group sao_lab.tools) that rows may name")


def enable_plugins(verifier_names: list[str], tool_env_names: list[str]) -> None:
    """Load the user verifiers and tool environments a run enables by name (its rows may name them)."""
    verifiers.enable(verifier_names)
    tool_envs.enable(tool_env_names)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sao replay", description=__doc__.splitlines()[0])
    p.add_argument("file", help="recorded task stream: .jsonl, .parquet or .csv")
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 replays twice as fast; 0: no waiting")
    p.add_argument("--out", help="write to this file (.jsonl, .parquet, .csv)")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers: publish to <run>.tasks")
    p.add_argument("--run", default="sao", help="run name (topic prefix) with --bootstrap")
    p.add_argument("--skip-bad", action="store_true", help="write bad rows to a side file and go on")
    p.add_argument("--rejects", help="side file for bad rows (default: FILE.rejects.jsonl)")
    p.add_argument("--restamp", action="store_true", help="set created_at to the time each task is sent")
    p.add_argument("--limit", type=int, default=None, help="stop after this many tasks")
    p.add_argument("--max-lag", type=int, default=0, metavar="N",
                   help="with --bootstrap: publish only while fewer than N tasks are uncommitted by the agents' "
                        "group (0: no back-pressure)")
    add_plugin_args(p)
    p.add_argument("--model", help="the served model's directory: prompts are checked against its tokenizer and "
                                    "context (default: the embedded character model's alphabet and length)")
    p.add_argument("--tag-window", type=int, default=TAG_WINDOW, metavar="N",
                   help="production rows: tag changes within N rows of each other are one drift event")
    p.add_argument("--chunk-rows", type=int, default=10_000, help="rows read at a time (Parquet)")
    p.add_argument("--max-gap", type=float, default=MAX_GAP_S,
                   help="recorded seconds a row's time may lie after the previous row's (a larger jump is a bad row)")
    args = p.parse_args(argv)
    if bool(args.out) == bool(args.bootstrap):
        p.error("give exactly one of --out FILE, --bootstrap SERVERS")
    if not 0 <= args.speed < float("inf"):
        p.error("--speed must be a finite number >= 0")
    if not 0 < args.max_gap < float("inf"):
        p.error("--max-gap must be a finite number > 0")
    return args


def main(argv: list[str], load_tokenizer: Callable[[str | Path], Any] | None = None) -> int:
    """`load_tokenizer(model_dir)`: reads the `--model` directory's tokenizer (`sao replay` passes
    `learner.models.tokenizer.load_tokenizer`; the simulator does not import the learner)."""
    args = parse_args(argv)
    if not Path(args.file).is_file():
        print(f"sao replay: {args.file}: no such file", file=sys.stderr)
        return 2
    try:
        enable_plugins(args.verifier, args.tool_env)
        rule = prompt_rule(args.model, load_tokenizer)
    except (OSError, ValueError) as e:  # a PluginError is a ValueError
        print(f"sao replay: {e}", file=sys.stderr)
        return 2
    if args.bootstrap:
        from simulator.run import kafka_sink

        sink = kafka_sink(args.bootstrap, args.run, args.max_lag)
    else:
        sink = file_sink(args.out)
    try:
        stats = replay(args.file, sink, args.speed, args.skip_bad, args.rejects, args.restamp, args.limit,
                       args.chunk_rows, args.max_gap, rule, args.tag_window)
    except ReplayError as e:
        print(f"sao replay: {e}", file=sys.stderr)
        return 1
    summary = dataclasses.asdict(stats)
    summary["bad_rows"] = summary["bad_rows"][:20]
    print(json.dumps(summary))
    return 0

"""Append-friendly writers of a run directory (`streamer.runs.layout`): rows from messages, parts, compaction.

A live run buffers rows and flushes them every `flush_seconds` to a new numbered part file, written
to a temporary name and renamed, so a reader never sees half a part. `close()` compacts the parts
into one file, renamed in place before the parts are removed; the file records the last part number
it holds, and readers take the file plus only the parts after that number, so no row is ever read
twice or missed, and a run restarted after compaction appends new parts that are read too. Closing
also fills each trajectory's learner step and version (`trained.fill_learner_columns`) and writes
summary.json (`summary.summarize`).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pandas as pd

from streamer.runs.adaptation import DEFAULT_DELTA, DEFAULT_WINDOW, staleness_from_histograms
from streamer.runs.layout import (
    COMPACTED,
    PART,
    TABLES,
    ArtifactError,
    checkpoints_dir,
    compacted_through,
    part_key,
    table_files,
    table_paths,
    write_atomic,
    write_json,
)
from streamer.runs.readers import read_table
from streamer.runs.summary import summarize
from streamer.runs.trained import fill_learner_columns
from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint, Trajectory, encode_json

MP_FIELDS = ("name", "value", "time", "window", "count", "trajectories", "learner_step")


def trajectory_row(t: Trajectory, learner_step: int | None = None,
                   learner_version: int | None = None) -> dict[str, Any]:
    """One row of trajectories.parquet; learner step/version are those at training time, when known
    (a live run leaves them NaN; `RunWriter.close` fills them from the learner's events)."""
    n_gen = int(sum(t.loss_mask))
    return {"traj_id": t.traj_id, "task_id": t.task_id, "family": t.family, "concept": t.concept,
            "phase": t.phase, "reward": float(t.reward), "success": bool(t.success),
            "policy_version": t.policy_version, "n_tokens": len(t.tokens), "n_gen_tokens": n_gen,
            "n_turns": t.n_turns, "n_tool_calls": t.n_tool_calls, "agent_id": t.agent_id,
            "group_id": t.group_id, "created_at": t.created_at, "started_at": t.started_at,
            "finished_at": t.finished_at, "gen_seconds": t.gen_seconds, "env_seconds": t.env_seconds,
            # NaN, not None, when unknown: the column stays float in every part, whatever the first part held
            "learner_step": math.nan if learner_step is None else float(learner_step),
            "learner_version": math.nan if learner_version is None else float(learner_version)}


def learner_row(e: LearnerEvent) -> dict[str, Any]:
    """One row of learner.parquet: the event's fields, each metric as a column named as the metric,
    and the staleness histogram as JSON plus its mean and max."""
    vals = staleness_from_histograms([e.staleness])
    row: dict[str, Any] = {"step": e.step, "version": e.version, "time": e.time,
                           "n_trajectories": e.n_trajectories, "n_tokens": e.n_tokens, "skipped": e.skipped,
                           "staleness": json.dumps(e.staleness, sort_keys=True),
                           "staleness_mean": float(vals.mean()) if vals.size else math.nan,
                           "staleness_max": float(vals.max()) if vals.size else math.nan,
                           "task_ids": json.dumps(e.task_ids)}
    for k, v in e.metrics.items():
        row[k if k not in row else f"metric:{k}"] = float(v)
    return row


def metric_row(m: MetricPoint) -> dict[str, Any]:
    """One row of metrics.parquet: the point's fields, and each label as a column named as the label
    (`label:<key>` where a label would shadow a field)."""
    row: dict[str, Any] = {k: getattr(m, k) for k in MP_FIELDS}
    for k, v in m.labels.items():
        row[k if k not in row else f"label:{k}"] = v
    return row


class TableWriter:
    """Buffers rows of one table and flushes them to numbered part files."""

    def __init__(self, run_dir: str | Path, table: str, flush_seconds: float = 2.0, flush_rows: int = 50_000,
                 writer_id: str = ""):
        if writer_id and not re.fullmatch(r"[A-Za-z0-9_.]+", writer_id):
            raise ArtifactError(f"writer_id '{writer_id}': use letters, digits, '_' or '.'")
        self.table = table
        self.single, self.parts = table_paths(run_dir, table)
        self.parts.mkdir(parents=True, exist_ok=True)
        self.flush_seconds, self.flush_rows, self.writer_id = flush_seconds, flush_rows, writer_id
        self.rows: list[dict[str, Any]] = []
        self.last_flush = time.monotonic()
        # a restarted writer continues its numbering (past its compacted parts too) instead of reusing it
        mine = [seq for seq, wid in (part_key(p.name) for p in self.parts.iterdir() if PART.match(p.name))
                if wid == writer_id]
        self.seq = max(mine + [compacted_through(self.single).get(writer_id, 0)])

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.maybe_flush()

    def maybe_flush(self) -> None:
        due = self.rows and time.monotonic() - self.last_flush >= self.flush_seconds
        if len(self.rows) >= self.flush_rows or due:
            self.flush()

    def flush(self) -> Path | None:
        self.last_flush = time.monotonic()
        if not self.rows:
            return None
        path = self._write_part(pd.DataFrame(self.rows))
        self.rows = []
        return path

    def _write_part(self, df: pd.DataFrame) -> Path:
        self.seq += 1
        suffix = f"-{self.writer_id}" if self.writer_id else ""
        path = self.parts / f"part-{self.seq:05d}{suffix}.parquet"
        self.parts.mkdir(parents=True, exist_ok=True)
        write_atomic(df, path)
        return path

    def write_frame(self, df: pd.DataFrame) -> Path:
        """Flush the buffer, then write `df` (rows of this table) as one part of its own."""
        self.flush()
        return self._write_part(df)

    def compact(self) -> Path:
        """Flush, then merge the parts into the single file and remove them. The file records, per
        writer, the last part number it holds, so a reader never counts a row twice (even
        mid-compaction) and parts another writer adds meanwhile or later are still read."""
        self.flush()
        files = table_files(self.single.parent, self.table)
        parts = [f for f in files if f != self.single]
        if parts:
            through = compacted_through(self.single)
            for p in parts:
                seq, wid = part_key(p.name)
                through[wid] = max(through.get(wid, 0), seq)
            df = read_table(self.single.parent, self.table)
            write_atomic(df, self.single, {COMPACTED: json.dumps(through, sort_keys=True)})
            for p in parts:
                p.unlink(missing_ok=True)
        for p in self.parts.glob("part-*.parquet"):  # leftovers of an interrupted compaction
            seq, wid = part_key(p.name)
            if seq <= compacted_through(self.single).get(wid, 0):
                p.unlink(missing_ok=True)
        # the (empty) parts directory stays: another writer of this table may still add parts to it
        return self.single


class RunWriter:
    """Writes one run directory. Call `maybe_flush()` from idle loops; `close()` at the end."""

    def __init__(self, run_dir: str | Path, config: dict[str, Any] | None = None, flush_seconds: float = 2.0,
                 writer_id: str = ""):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        checkpoints_dir(self.dir).mkdir(exist_ok=True)
        if config is not None:
            write_json(self.dir / "config.json", config)
        self.tables = {t: TableWriter(self.dir, t, flush_seconds, writer_id=writer_id) for t in TABLES}
        self._drift = open(self.dir / "drift.jsonl", "ab")

    def trajectory(self, t: Trajectory, learner_step: int | None = None, learner_version: int | None = None) -> None:
        self.tables["trajectories"].add(trajectory_row(t, learner_step, learner_version))

    def learner_event(self, e: LearnerEvent) -> None:
        self.tables["learner"].add(learner_row(e))

    def metric(self, m: MetricPoint) -> None:
        self.tables["metrics"].add(metric_row(m))

    def drift(self, e: DriftEvent) -> None:
        # one write of a whole line, flushed at once: drift events are rare and the dashboard marks them
        self._drift.write(encode_json(e) + b"\n")
        self._drift.flush()

    def maybe_flush(self) -> None:
        for w in self.tables.values():
            w.maybe_flush()

    def flush(self) -> None:
        for w in self.tables.values():
            w.flush()

    def close(self, compact: bool = True, summary: bool = True, window: int = DEFAULT_WINDOW,
              delta: float = DEFAULT_DELTA) -> None:
        """Flush (and with `compact`, merge the parts and fill trajectories.parquet's learner columns
        from the learner's events: `fill_learner_columns`), then write summary.json."""
        for w in self.tables.values():
            w.compact() if compact else w.flush()
        self._drift.close()
        if compact:
            fill_learner_columns(self.dir)
        if summary:
            write_json(self.dir / "summary.json", summarize(self.dir, window, delta))

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

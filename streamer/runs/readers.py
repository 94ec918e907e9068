"""Tolerant readers of a run directory (`streamer.runs.layout`): what a live or finished run holds so far.

A table is its compacted file plus only the parts written after it (`layout.table_files`), so no
row is read twice or missed, even mid-compaction; an unreadable part (a copy in progress) is
skipped with a warning, an unreadable single file raises ArtifactError. Trajectory rows gain `seq`,
the task's stream position, from the task id.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from streamer.runs.layout import TABLES, ArtifactError, table_files, table_paths
from streamer.wire.schema import DriftEvent, SchemaError, decode_json


def read_part(path: Path, columns: Iterable[str] | None = None, categorical: Iterable[str] = ()) -> pd.DataFrame:
    """One parquet file; `columns`: only those (the ones this file has), `categorical`: string columns
    to read as pandas categoricals. Both much faster on a million rows. A file with task ids and no
    `seq` gets one (`task_seq`) unless `columns` leaves it out."""
    have = set(pq.read_schema(path).names)
    wanted = None if columns is None else list(columns)
    derive = "seq" not in have and "task_id" in have and (wanted is None or "seq" in wanted)
    cols = None if wanted is None else [c for c in wanted if c in have] + (["task_id"] if derive else [])
    cats = [c for c in categorical if c in have and (cols is None or c in cols)]
    table = pq.read_table(path, columns=list(dict.fromkeys(cols)) if cols is not None else None,
                          read_dictionary=cats or None)
    if derive:
        table = table.append_column("seq", task_seq(table["task_id"]))
        if wanted is not None and "task_id" not in wanted:
            table = table.drop(["task_id"])
    return table.to_pandas()


def task_seq(task_ids: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """The stream position of each task from its id: the simulator names tasks `<scenario>-<seed>-<seq>`
    (null where an id does not end in `-<digits>`). Trajectory rows carry no seq of their own."""
    ids = pc.cast(task_ids, pa.string())
    return pc.cast(pc.struct_field(pc.extract_regex(ids, r"-(?P<seq>\d+)$"), [0]), pa.int64())


def read_table(run_dir: str | Path, table: str, read_part=read_part) -> pd.DataFrame:
    """All rows of a table so far (empty DataFrame when none). An unreadable part is skipped with a
    warning; an unreadable single file raises ArtifactError."""
    single, _ = table_paths(run_dir, table)
    for _ in range(3):  # a compaction removed a part between our listing and reading it: list again
        frames = []
        try:
            for f in table_files(run_dir, table):
                try:
                    frames.append(read_part(f))
                except FileNotFoundError:
                    raise
                except (OSError, pa.ArrowException) as e:
                    if f == single:
                        raise ArtifactError(f"{single}: unreadable ({e})") from None
                    warnings.warn(f"{f}: skipped unreadable part ({e})", stacklevel=2)
        except FileNotFoundError:
            continue
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return pd.DataFrame()


def read_trajectories(run_dir: str | Path) -> pd.DataFrame:
    return read_table(run_dir, "trajectories")


def read_learner(run_dir: str | Path) -> pd.DataFrame:
    """The learner events that stand (`standing`): a step a restart redid counts once, as redone."""
    return standing(read_table(run_dir, "learner"))


def standing(learner: pd.DataFrame) -> pd.DataFrame:
    """The events that stand, in emission order: a learner restarted from its checkpoint at step s emits s+1,
    s+2, ... again, so a later event of step s' replaces every earlier event of a step >= s'."""
    if not len(learner) or "step" not in learner:
        return learner
    stack: list[int] = []  # row positions of the standing events, steps increasing
    steps = learner["step"].to_numpy()
    for i, s in enumerate(steps):  # table order is emission order
        while stack and steps[stack[-1]] >= s:
            stack.pop()
        stack.append(i)
    return learner.iloc[stack].reset_index(drop=True)


def read_metrics(run_dir: str | Path) -> pd.DataFrame:
    return read_table(run_dir, "metrics")


def read_drift(run_dir: str | Path) -> list[DriftEvent]:
    """Drift events; a torn last line (being written) is skipped, a bad line elsewhere raises."""
    path = Path(run_dir) / "drift.jsonl"
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    events = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(decode_json(line, DriftEvent))
        except SchemaError as e:
            if i == len(lines):  # no newline yet: a partial write
                continue
            raise ArtifactError(f"{path}:{i}: {e}") from None
    return events


def read_json(path: str | Path) -> dict[str, Any] | None:
    p = Path(path)
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{p}: unreadable JSON ({e})") from None


def read_config(run_dir: str | Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / "config.json")


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / "summary.json")


def list_runs(root: str | Path) -> list[Path]:
    """Run directories under `root` (those holding any artifact), most recently modified first."""
    r = Path(root)
    if not r.is_dir():
        return []
    marks = ("config.json", "drift.jsonl", "summary.json") + tuple(TABLES) + tuple(f"{t}.parquet" for t in TABLES)
    runs = [d for d in r.iterdir() if d.is_dir() and any((d / m).exists() for m in marks)]
    return sorted(runs, key=lambda d: d.stat().st_mtime, reverse=True)

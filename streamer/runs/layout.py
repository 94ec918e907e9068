"""Where each file of a run directory lives, and how a file is replaced atomically.

    runs/<run>/config.json           the run's configuration (any JSON object)
    runs/<run>/<table>/part-00001[-<writer>].parquet ...   a table's rows while the run is live
    runs/<run>/<table>.parquet       the same rows in one file, once compacted; its parquet metadata
                                     records, per writer, the last part number it holds
    runs/<run>/drift.jsonl           DriftEvent JSON lines
    runs/<run>/summary.json          the run's summary (written at close; present = finished)
    runs/<run>/checkpoints/          the learner's checkpoints

Tables: trajectories, learner, metrics. Files are written to a temporary name and renamed, so a
reader never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

TABLES = ("trajectories", "learner", "metrics")
PART = re.compile(r"^part-(\d+)(?:-([A-Za-z0-9_.]+))?\.parquet$")
COMPACTED = "sao.compacted_through"  # parquet metadata key of a table's single file: {writer_id: last part merged}


class ArtifactError(ValueError):
    """A run directory or file that cannot be read (the text names the path)."""


def table_paths(run_dir: str | Path, table: str) -> tuple[Path, Path]:
    """(single file, parts directory) of a table."""
    if table not in TABLES:
        raise ArtifactError(f"unknown table '{table}' (known: {', '.join(TABLES)})")
    run = Path(run_dir)
    return run / f"{table}.parquet", run / table


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def part_key(name: str) -> tuple[int, str]:
    """'part-00003-tap.parquet' -> (3, 'tap')."""
    m = PART.match(name)
    return int(m.group(1)), m.group(2) or ""


def compacted_through(single: Path) -> dict[str, int]:
    """Per writer id ("" for none), the last part number merged into a table's single file."""
    try:
        meta = pq.read_schema(single).metadata or {}
    except FileNotFoundError:
        return {}
    except (OSError, pa.ArrowException) as e:
        raise ArtifactError(f"{single}: unreadable ({e})") from None
    raw = meta.get(COMPACTED.encode())
    try:
        return {str(k): int(v) for k, v in json.loads(raw).items()} if raw else {}
    except (ValueError, AttributeError):
        raise ArtifactError(f"{single}: bad {COMPACTED} metadata {raw!r}") from None


def table_files(run_dir: str | Path, table: str) -> list[Path]:
    """The files holding a table now: the single file (if any), then the parts not merged into it,
    in order. Parts never change once written, so a reader may cache each one by path."""
    single, parts = table_paths(run_dir, table)
    done = compacted_through(single)
    files = [single] if single.exists() else []
    if parts.is_dir():
        keys = [(part_key(p.name), p.name) for p in parts.iterdir() if PART.match(p.name)]
        # in order of part number then writer: each writer's rows stay in the order it wrote them
        files += [parts / n for (seq, wid), n in sorted(keys) if seq > done.get(wid, 0)]
    return files


def write_atomic(df: pd.DataFrame, path: Path, metadata: dict[str, str] | None = None) -> None:
    """`df` as a parquet file at `path`, written aside and renamed; `metadata` added to its schema."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    table = pa.Table.from_pandas(df, preserve_index=False)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(finite(obj)), indent=2))
    os.replace(tmp, path)


def finite(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if obj is pd.NA:
        return None
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return finite(obj.item())
    return obj

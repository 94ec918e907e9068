"""The run directory `runs/<run>/`: its layout, append-friendly writers and tolerant readers.

    runs/<run>/config.json           the run's configuration (any JSON object)
    runs/<run>/trajectories/part-00001.parquet ...   one row per trajectory (live run)
    runs/<run>/trajectories.parquet  the same rows in one file (after `RunWriter.close`, which also fills each
                                     row's learner_step/learner_version from the learner's events)
                                     (readers add `seq`, the task's stream position, from its id)
    runs/<run>/learner/part-*.parquet | learner.parquet   one row per LearnerEvent, metrics as columns
    runs/<run>/metrics/part-*.parquet | metrics.parquet   MetricPoint rows, labels as columns
    runs/<run>/drift.jsonl           DriftEvent JSON lines
    runs/<run>/summary.json          `summarize(run_dir)` (written at close; present = finished)
    runs/<run>/checkpoints/          the learner's checkpoints

A live run buffers rows and flushes them every `flush_seconds` to a new numbered part file,
written to a temporary name and renamed, so a reader never sees half a part; readers still skip
an unreadable part (e.g. a copy in progress) rather than fail. `close()` compacts the parts into
one file, renamed in place before the parts are removed; the file records the last part number it
holds, and readers take the file plus only the parts after that number, so no row is ever read
twice or missed, and a run restarted after compaction appends new parts that are read too.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Iterable

import msgspec
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from streamer.runs import adaptation as ad
from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint, SchemaError, Trajectory, decode_json, encode_json

TABLES = ("trajectories", "learner", "metrics")
_PART = re.compile(r"^part-(\d+)(?:-([A-Za-z0-9_.]+))?\.parquet$")
# parquet metadata key of a table's single file: JSON {writer_id: last part number merged}
_COMPACTED = "sao.compacted_through"
MP_FIELDS = ("name", "value", "time", "window", "count", "trajectories", "learner_step")


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


# ---------------------------------------------------------------- rows from messages

def trajectory_row(t: Trajectory, learner_step: int | None = None, learner_version: int | None = None) -> dict[str, Any]:
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
    vals = ad.staleness_from_histograms([e.staleness])
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


# ---------------------------------------------------------------- writers

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
        mine = [seq for seq, wid in (_part_key(p.name) for p in self.parts.iterdir() if _PART.match(p.name))
                if wid == writer_id]
        self.seq = max(mine + [compacted_through(self.single).get(writer_id, 0)])

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.maybe_flush()

    def maybe_flush(self) -> None:
        if len(self.rows) >= self.flush_rows or (self.rows and time.monotonic() - self.last_flush >= self.flush_seconds):
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
        _write_atomic(df, path)
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
                seq, wid = _part_key(p.name)
                through[wid] = max(through.get(wid, 0), seq)
            df = read_table(self.single.parent, self.table)
            _write_atomic(df, self.single, {_COMPACTED: json.dumps(through, sort_keys=True)})
            for p in parts:
                p.unlink(missing_ok=True)
        for p in self.parts.glob("part-*.parquet"):  # leftovers of an interrupted compaction
            seq, wid = _part_key(p.name)
            if seq <= compacted_through(self.single).get(wid, 0):
                p.unlink(missing_ok=True)
        # the (empty) parts directory stays: another writer of this table may still add parts to it
        return self.single


def _write_atomic(df: pd.DataFrame, path: Path, metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    table = pa.Table.from_pandas(df, preserve_index=False)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    pq.write_table(table, tmp)
    os.replace(tmp, path)


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

    def close(self, compact: bool = True, summary: bool = True, window: int = ad.DEFAULT_WINDOW,
              delta: float = ad.DEFAULT_DELTA) -> None:
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


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(_finite(obj)), indent=2))
    os.replace(tmp, path)


def _finite(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if obj is pd.NA:
        return None
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return _finite(obj.item())
    return obj


# ---------------------------------------------------------------- readers

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


def compacted_through(single: Path) -> dict[str, int]:
    """Per writer id ("" for none), the last part number merged into a table's single file."""
    try:
        meta = pq.read_schema(single).metadata or {}
    except FileNotFoundError:
        return {}
    except (OSError, pa.ArrowException) as e:
        raise ArtifactError(f"{single}: unreadable ({e})") from None
    raw = meta.get(_COMPACTED.encode())
    try:
        return {str(k): int(v) for k, v in json.loads(raw).items()} if raw else {}
    except (ValueError, AttributeError):
        raise ArtifactError(f"{single}: bad {_COMPACTED} metadata {raw!r}") from None


def _part_key(name: str) -> tuple[int, str]:
    """'part-00003-tap.parquet' -> (3, 'tap')."""
    m = _PART.match(name)
    return int(m.group(1)), m.group(2) or ""


def table_files(run_dir: str | Path, table: str) -> list[Path]:
    """The files holding a table now: the single file (if any), then the parts not merged into it,
    in order. Parts never change once written, so a reader may cache each one by path."""
    single, parts = table_paths(run_dir, table)
    done = compacted_through(single)
    files = [single] if single.exists() else []
    if parts.is_dir():
        keys = [(_part_key(p.name), p.name) for p in parts.iterdir() if _PART.match(p.name)]
        # in order of part number then writer: each writer's rows stay in the order it wrote them
        files += [parts / n for (seq, wid), n in sorted(keys) if seq > done.get(wid, 0)]
    return files


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


# ---------------------------------------------------------------- which step trained each trajectory

def effective_events(learner: pd.DataFrame) -> pd.DataFrame:
    """The learner events that stand, in step order, with `version_before`: the policy version the step
    trained at (the one it started from, against which its staleness histogram is counted; the
    event's own `version` is the one after it). A learner restarted from its checkpoint at step s
    emits s+1, s+2, ... again: a later event of step s' replaces every earlier event of a step >= s'.
    The version before a step is the version after the step that stands before it; 0 before step 1;
    NaN when the step before is missing from the table."""
    cols = ["step", "version", "version_before", "skipped", "task_ids"]
    if not len(learner) or "step" not in learner:
        return pd.DataFrame(columns=cols)
    ev = standing(learner)
    version = pd.to_numeric(ev["version"], errors="coerce").astype(float)
    before = version.shift(1)
    contiguous = ev["step"].diff() == 1
    before = before.where(contiguous, math.nan)
    before[ev["step"] == 1] = 0.0  # the trainer starts at version 0
    skipped = ev["skipped"].fillna(False).astype(bool) if "skipped" in ev else pd.Series(False, index=ev.index)
    ids = ev["task_ids"] if "task_ids" in ev else pd.Series([[]] * len(ev))
    return pd.DataFrame({"step": ev["step"].to_numpy(), "version": version.to_numpy(),
                         "version_before": before.to_numpy(), "skipped": skipped.to_numpy(),
                         "task_ids": [json.loads(x) if isinstance(x, str) else list(x if x is not None else [])
                                      for x in ids]}, columns=cols)


def trained_by(trajectories: pd.DataFrame, learner: pd.DataFrame) -> pd.DataFrame:
    """Per trajectory row (same index): `learner_step`, the applied learner step that trained it, and
    `learner_version`, the policy version it was trained at (`effective_events`' version_before, so
    learner_version - policy_version is the staleness the learner counted); NaN where never trained.
    Events name tasks, not trajectories: a task's k-th trajectory (in finish order) goes with its k-th
    mention in the standing applied events (in step order), which pairs a group's n trajectories with
    the n mentions of its task and a re-answered task's copies with the steps that trained them. Steps
    whose update was skipped (non-finite) trained nothing."""
    out = pd.DataFrame({"learner_step": math.nan, "learner_version": math.nan}, index=trajectories.index)
    ev = effective_events(learner)
    ev = ev[~ev["skipped"]]
    if not len(trajectories) or not len(ev) or "task_id" not in trajectories:
        return out
    mentions = ev[["step", "version_before", "task_ids"]].explode("task_ids").dropna(subset=["task_ids"])
    mentions = mentions.rename(columns={"task_ids": "task_id"}).astype({"task_id": str})
    mentions["k"] = mentions.groupby("task_id", sort=False).cumcount()
    order = (trajectories["finished_at"] if "finished_at" in trajectories
             else pd.Series(range(len(trajectories)), index=trajectories.index))
    traj = pd.DataFrame({"task_id": trajectories["task_id"].astype(str).to_numpy(), "t": order.to_numpy(),
                         "pos": range(len(trajectories))})
    traj = traj.sort_values(["t", "pos"], kind="stable")
    traj["k"] = traj.groupby("task_id", sort=False).cumcount()
    hit = traj.merge(mentions, on=["task_id", "k"], how="inner")
    pos = hit["pos"].to_numpy()
    out.iloc[pos, 0] = hit["step"].to_numpy(float)
    out.iloc[pos, 1] = hit["version_before"].to_numpy(float)
    return out


def fill_learner_columns(run_dir: str | Path) -> int:
    """Fill the NaN `learner_step`/`learner_version` cells of a run's compacted trajectories.parquet
    from its learner table (`trained_by`), keeping the file's metadata; rows never trained stay NaN,
    values already set are kept. Run once the learner has stopped (`RunWriter.close` does, after
    compaction). Returns the number of rows filled."""
    single, _ = table_paths(run_dir, "trajectories")
    if not single.exists():
        return 0
    learner = read_learner(run_dir)
    if not len(learner) or "task_ids" not in learner:
        return 0
    try:
        table = pq.read_table(single)
    except (OSError, pa.ArrowException) as e:
        raise ArtifactError(f"{single}: unreadable ({e})") from None
    df = table.to_pandas()
    if not len(df):
        return 0
    found = trained_by(df, learner)
    filled = 0
    for col in ("learner_step", "learner_version"):
        have = pd.to_numeric(df[col], errors="coerce").astype(float) if col in df else \
            pd.Series(math.nan, index=df.index)
        new = have.fillna(found[col])
        filled = max(filled, int((have.isna() & new.notna()).sum()))
        df[col] = new
    if filled:
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items() if k != b"pandas"}
        _write_atomic(df, single, meta)
    return filled


# ---------------------------------------------------------------- summary

def summarize(run_dir: str | Path, window: int = ad.DEFAULT_WINDOW, delta: float = ad.DEFAULT_DELTA,
              floor: float = ad.DEFAULT_FLOOR) -> dict[str, Any]:
    """AUC, recovery of every (drift event, family) (`adaptation.drift_recoveries`) and its counts per
    status, final reward per concept, staleness, throughput and the learner's shares."""
    traj, learner, metrics = read_trajectories(run_dir), read_learner(run_dir), read_metrics(run_dir)
    drift = [msgspec.to_builtins(e) for e in read_drift(run_dir)]
    out: dict[str, Any] = {"run": Path(run_dir).name, "window": window, "delta": delta, "floor": floor,
                           "n_trajectories": int(len(traj)), "n_learner_steps": int(len(learner)),
                           "n_drift_events": len(drift)}
    if len(traj):
        traj = ad.sort_by(traj, "finished_at")
        out["auc"] = ad.auc(traj["reward"].to_numpy(float), window)
        out["auc_per_family"] = {f: ad.auc(g["reward"].to_numpy(float), window) for f, g in traj.groupby("family")}
        out["final_reward_per_concept"] = {
            f"{f}/{c}": float(g["reward"].to_numpy(float)[-window:].mean()) for (f, c), g in traj.groupby(["family", "concept"])}
        out["trajectories_per_s"] = ad.rate(traj["finished_at"])
    rec = ad.drift_recoveries(traj, drift, learner, window, delta, floor)
    out["recoveries"] = rec.to_dict(orient="records")
    out["recovery_summary"] = ad.recovery_summary(rec)
    out["staleness"] = _staleness(traj, learner)
    out["trained_fraction"] = ad.trained_fraction(learner, len(traj))
    out["learner_busy_share"] = ad.learner_busy_share(learner)
    if len(learner):
        out["learner_tokens_per_s"] = ad.rate(learner["time"], learner["n_tokens"])
        out["learner_steps_per_s"] = ad.rate(learner["time"])
        # idle-time metrics of the learner (e.g. "perf/idle_s"): their mean over the run
        out["learner_idle"] = {c: float(pd.to_numeric(learner[c], errors="coerce").mean())
                               for c in learner.columns if re.match(r"^idle", str(c).rsplit("/", 1)[-1])}
    out["forgetting"] = forgetting_rows(metrics, drift, traj)
    return _finite(out)


def _staleness(traj: pd.DataFrame, learner: pd.DataFrame) -> dict[str, float]:
    if len(traj) and "learner_version" in traj and traj["learner_version"].notna().any():
        return ad.staleness_stats((traj["learner_version"] - traj["policy_version"]).to_numpy(float))
    if len(learner) and "staleness" in learner:
        return ad.staleness_stats(ad.staleness_from_histograms(json.loads(s) for s in learner["staleness"]))
    return ad.staleness_stats([])


def eval_points(metrics: pd.DataFrame) -> pd.DataFrame:
    """Eval rewards per concept: MetricPoint rows named `eval/reward` with a `concept` label."""
    if not len(metrics) or "concept" not in metrics or "name" not in metrics:
        return pd.DataFrame(columns=["time", "concept", "value", "family"])
    ev = metrics[metrics["name"] == "eval/reward"]
    cols = ["time", "concept", "value"] + (["family"] if "family" in ev else [])
    return ev[cols].reset_index(drop=True)


def forgetting_rows(metrics: pd.DataFrame, drift: list[dict], traj: pd.DataFrame) -> list[dict]:
    """Forgetting of each recurring concept (`adaptation.forgetting`). A concept leaves when its
    drift reached the agents (`adaptation.drift_times`: the first finish of a trajectory of the new
    block), not when the event was published."""
    ev = eval_points(metrics)
    if not len(ev) or not drift:
        return []
    drift = [dict(e, time=t) for e, t in zip(drift, ad.drift_times(traj, drift))]
    t0 = float(traj["created_at"].min()) if len(traj) else float(ev["time"].min())
    t1 = float(max(ev["time"].max(), traj["finished_at"].max() if len(traj) else -math.inf))
    families = sorted({f for e in drift for f in e.get("concepts", {})})
    rows = []
    for fam in families:
        iv = ad.concept_intervals(drift, fam, t0, t1)
        sub = ev[ev["family"] == fam] if "family" in ev else ev
        rows += [dict(r, family=fam) for r in ad.forgetting(sub, iv).to_dict(orient="records")]
    return rows

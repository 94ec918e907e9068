"""Which learner step trained each trajectory: filled into trajectories.parquet once the run is over.

Learner events name tasks, not trajectories, and a restarted learner emits some steps again; the
events that stand (`readers.standing`) and the versions they trained at are matched to the
trajectory rows by task and order (`trained_by`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from streamer.runs.layout import ArtifactError, table_paths, write_atomic
from streamer.runs.readers import read_learner, standing


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
        write_atomic(df, single, meta)
    return filled

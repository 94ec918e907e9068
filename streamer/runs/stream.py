"""The task stream's order and its drift blocks: where each trajectory stands relative to the drift events.

Measured on the stream position (the task's seq, or created_at), never on wall time: the whole
stream may be published in seconds and answered out of order, so a drift's publish time says
nothing about which trajectories came before it. A trajectory's phase is its `phase` column; a
block inside a phase (recurring, incremental drifts) starts at the event's `at_seq`. Recovery and
forgetting (`streamer.runs.recovery`, `streamer.runs.forgetting`) both cut the stream here.
Also the learner's policy updates, which recovery counts.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from streamer.runs.reward import require


def stream_position(trajectories: pd.DataFrame) -> tuple[np.ndarray, str]:
    """Each trajectory's place in the task stream and its unit: the task's `seq` when every row has
    one (artifacts.read_part derives it from the simulator's task ids), else the task's
    `created_at` (also in stream order). Never the finish time: tasks are answered out of order."""
    if "seq" in trajectories and len(trajectories):
        seq = pd.to_numeric(trajectories["seq"], errors="coerce").to_numpy(float)
        if not np.isnan(seq).any():
            return seq, "seq"
    require(trajectories, ("created_at",), "trajectories (no seq)")
    return trajectories["created_at"].to_numpy(float), "created_at"


def in_stream_order(trajectories: pd.DataFrame) -> pd.DataFrame:
    """The rows sorted by stream position (then finish time), index reset, with a `pos` column."""
    pos, _ = stream_position(trajectories)
    fin = trajectories["finished_at"].to_numpy(float) if "finished_at" in trajectories else np.zeros(len(pos))
    order = np.lexsort((fin, pos))
    return trajectories.iloc[order].reset_index(drop=True).assign(pos=pos[order])


def sort_events(drift_events: Iterable[Mapping]) -> list[Mapping]:
    """Drift events in stream order: by phase, then task sequence number (then time)."""
    return sorted(drift_events, key=lambda e: (e["phase"], e.get("at_seq", 0), e.get("time", 0.0)))


def changed(event: Mapping) -> list[str]:
    """The families whose rewarded concept the event changes (events list every family)."""
    prev = event.get("prev_concepts", {})
    return [f for f, k in event.get("concepts", {}).items() if prev.get(f) != k]


def drift_kind(event: Mapping) -> str:
    """Drift type of an event: its schedule, or 'tool-api' for an abrupt change of the tool family."""
    if event.get("schedule") == "abrupt" and "tool" in changed(event):
        return "tool-api"
    return str(event.get("schedule", "?"))


def drift_segments(trajectories: pd.DataFrame, events: list[Mapping]) -> np.ndarray:
    """For each row, how many of `events` (in stream order, `sort_events`) precede it: 0 before the
    first event, k in the block the k-th event starts. A phase comes from the row's `phase` column;
    a block inside a phase (recurring, incremental: phase == prev_phase) from its stream position
    (seq >= at_seq, or created_at > the event's time when the rows carry no seq)."""
    require(trajectories, ("phase",), "trajectories")
    phase = trajectories["phase"].to_numpy()
    seg = np.zeros(len(trajectories), dtype=np.int64)
    pos, unit = stream_position(trajectories) if any(e["phase"] == e.get("prev_phase") for e in events) else (None, "")
    for e in events:
        same = phase == e["phase"]
        if e["phase"] == e.get("prev_phase"):
            same &= pos >= e.get("at_seq", 0) if unit == "seq" else pos > e.get("time", 0.0)
        seg += (phase > e["phase"]) | same
    return seg


def stream_blocks(trajectories: pd.DataFrame, events: list[Mapping], columns: Iterable[str]) -> list[pd.DataFrame]:
    """The rows in stream order (`in_stream_order`), cut into len(events) + 1 blocks by `drift_segments`
    (`events` already in stream order). `columns`: those every row must have."""
    if not len(trajectories):
        empty = pd.DataFrame({c: [] for c in tuple(columns) + ("pos",)})
        return [empty] * (len(events) + 1)
    require(trajectories, columns, "trajectories")
    df = in_stream_order(trajectories)
    seg = drift_segments(df, events)
    return [df[seg == k] for k in range(len(events) + 1)]


def family_rows(block: pd.DataFrame, family: str, concept: str | None) -> pd.DataFrame:
    """A block's rows of `family` rewarded under `concept` (a gradual drift's old-concept tasks are left out)."""
    keep = block["family"] == family
    if concept is not None and "concept" in block:
        keep &= block["concept"] == concept
    return block[keep]


def drift_times(trajectories: pd.DataFrame, drift_events: Iterable[Mapping]) -> list[float]:
    """When each event (in the given order) reached the agents: the first finish of a trajectory of
    its block, or the event's own time when its block has none (the publish time of the event
    says nothing when the whole stream is published at once)."""
    events = list(drift_events)
    if not len(trajectories) or not events:
        return [float(e.get("time", math.nan)) for e in events]
    ordered = sort_events(events)
    seg, fin = drift_segments(trajectories, ordered), trajectories["finished_at"].to_numpy(float)
    first = {id(e): fin[seg == k].min() if (seg == k).any() else math.nan for k, e in enumerate(ordered, 1)}
    return [float(first[id(e)]) if math.isfinite(first[id(e)]) else float(e.get("time", math.nan)) for e in events]


def policy_updates(learner: pd.DataFrame | None) -> np.ndarray | None:
    """Sorted versions published by learner steps that changed the policy (applied, not critic-only
    warm-up); None without learner events (versions are then taken as updates)."""
    if learner is None or not len(learner) or "version" not in learner:
        return None
    ok = np.ones(len(learner), dtype=bool)
    if "skipped" in learner:
        ok &= ~learner["skipped"].fillna(False).astype(bool).to_numpy()
    if "learner/value_warmup" in learner:
        ok &= pd.to_numeric(learner["learner/value_warmup"], errors="coerce").to_numpy(float) != 1.0
    return np.sort(learner["version"].to_numpy(float)[ok])


def policy_steps(updates: np.ndarray | None, v0: float, v1: float) -> int | None:
    """Policy updates published after version v0, up to and including v1."""
    if updates is None or not math.isfinite(v0) or not math.isfinite(v1):
        return None
    return int(np.count_nonzero((updates > v0) & (updates <= v1)))


def first_update_after(updates: np.ndarray | None, v0: float) -> float:
    """The first policy version that holds an update made after v0 (inf when none yet)."""
    if updates is None:
        return v0 + 1
    later = updates[updates > v0]
    return float(later[0]) if later.size else math.inf

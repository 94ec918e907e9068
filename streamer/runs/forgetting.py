"""Forgetting: how much of an old concept's reward is gone when the concept comes back.

The one definition (summary.json, dashboard, benchmarks), on the online reward and the stream's
drift blocks (`streamer.runs.stream`), like recovery. Per family, the blocks between drift events
are joined into stretches of one rewarded concept (an event that leaves the family's concept as it
was does not end a stretch). When a concept is rewarded again after other concepts were
(recurring drifts, an incremental drift returning), forgetting = the mean reward of its first W
trajectories in the new stretch minus the mean of its last W trajectories in the stretch before it
left (fewer than W when the stretch holds fewer; NaN when a side holds none). Negative: forgotten.
Only the family's rows of the stretch's concept count (a gradual drift's old-concept tasks are left
out), in stream order, never finish order: tasks are answered out of order.

Why online rather than the held-out evaluator's eval/reward: every run has the online reward (the
evaluator is optional and samples the policy at wall-clock moments), and recovery is measured on
the same rows, so the two read together. Eval reward per concept stays a dashboard chart.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
import pandas as pd

from streamer.runs.reward import DEFAULT_WINDOW, check_window, mean_or_nan
from streamer.runs.stream import family_rows, sort_events, stream_blocks

FORGETTING_COLUMNS = ["family", "concept", "left_phase", "left_at_seq", "recurs_phase", "recurs_at_seq",
                      "before", "after", "forgetting", "n_before", "n_after"]
_COLUMNS = ("phase", "family", "concept", "reward")


def forgetting(trajectories: pd.DataFrame, drift_events: Iterable[Mapping],
               window: int = DEFAULT_WINDOW) -> pd.DataFrame:
    """One row per recurrence of a (family, concept): columns FORGETTING_COLUMNS. `trajectories`:
    columns phase, family, concept, reward and seq or created_at; `drift_events`: DriftEvent dicts.
    left_* name the event that ended the concept's previous stretch, recurs_* the one that brought it back."""
    check_window(window)
    events = sort_events(drift_events)
    blocks = stream_blocks(trajectories, events, _COLUMNS)
    families = sorted({f for e in events for f in (*e.get("concepts", {}), *e.get("prev_concepts", {}))})
    rows = [row for fam in families for row in _family_forgetting(fam, events, blocks, window)]
    return pd.DataFrame(rows, columns=FORGETTING_COLUMNS)


def _stretches(family: str, events: list[Mapping]) -> list[tuple[str | None, list[int], Mapping | None]]:
    """(concept, block indices, the event that started it) for each stretch of one concept of `family`."""
    first = next((e for e in events if family in e.get("prev_concepts", {}) or family in e.get("concepts", {})), None)
    concept = (first or {}).get("prev_concepts", {}).get(family)
    out: list[tuple[str | None, list[int], Mapping | None]] = [(concept, [0], None)]
    for k, e in enumerate(events, 1):
        new = e.get("concepts", {}).get(family, out[-1][0])
        if new == out[-1][0]:
            out[-1][1].append(k)
        else:
            out.append((new, [k], e))
    return out


def _family_forgetting(family: str, events: list[Mapping], blocks: list[pd.DataFrame], window: int) -> list[dict]:
    rows, last_seen = [], {}  # concept -> (its rewards in the stretch, the event that ended the stretch)
    stretches = _stretches(family, events)
    for i, (concept, ks, started) in enumerate(stretches):
        rewards = np.concatenate([family_rows(blocks[k], family, concept)["reward"].to_numpy(float) for k in ks])
        if concept is not None and concept in last_seen:
            old, left = last_seen[concept]
            before, after = mean_or_nan(old[-window:]), mean_or_nan(rewards[:window])
            rows.append({"family": family, "concept": concept, "left_phase": left["phase"],
                         "left_at_seq": left.get("at_seq"), "recurs_phase": started["phase"],
                         "recurs_at_seq": started.get("at_seq"), "before": before, "after": after,
                         "forgetting": after - before if math.isfinite(before + after) else math.nan,
                         "n_before": int(min(old.size, window)), "n_after": int(min(rewards.size, window))})
        if i + 1 < len(stretches):
            last_seen[concept] = (rewards, stretches[i + 1][2])
    return rows


def forgetting_mean(rows: pd.DataFrame | list[dict]) -> float:
    """Mean forgetting over recurrences that have both sides (NaN when none)."""
    v = pd.to_numeric(pd.DataFrame(rows, columns=FORGETTING_COLUMNS)["forgetting"], errors="coerce").dropna()
    return float(v.mean()) if len(v) else math.nan

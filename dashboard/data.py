"""The dashboard's data: a run's tables, and the frames each view plots (pure functions, no Streamlit).

Every view frame carries three x columns so the x-axis can be switched without recomputing:
`x_time` (seconds since the run's first event), `x_traj` (trajectories finished so far) and
`x_step` (learner steps done so far).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import msgspec
import numpy as np
import pandas as pd

from dashboard.downsample import downsample
from streamer.runs import adaptation as ad
from streamer.runs import artifacts as art
from streamer.runs.samples import SAMPLES_FILE, AnswerSample, latest_per_key, read_samples
from streamer.wire.reductions import reduce_values

X_AXES = {"wall time (s)": "x_time", "trajectories": "x_traj", "learner steps": "x_step"}

# Learner metric columns per view, matched on the last path segment of the column name
# ("learner/clip_frac_low" and "clip_frac_low" both match), so namespaces may change.
VIEW_METRICS: dict[str, str] = {
    "clip": r"^(clip|mask(ed)?)_frac_(low|high)$",
    "value_loss": r"^value_loss$",
    "explained_variance": r"^explained_var(iance)?$",
    "kl_entropy": r"^(kl(_k[123])?|entropy)$",
    "idle": r"^idle(_s|_seconds|_frac(tion)?)?$",
    "ess": r"^ess_frac$",
}


@dataclasses.dataclass
class RunData:
    name: str
    trajectories: pd.DataFrame
    learner: pd.DataFrame
    metrics: pd.DataFrame
    drift: list[dict[str, Any]]
    config: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    samples: list[AnswerSample] = dataclasses.field(default_factory=list)  # samples.jsonl: answers as text

    _axes: "Axes | None" = dataclasses.field(default=None, repr=False)

    @property
    def axes(self) -> "Axes":
        """The run's x-axis mapping, built once (the frames below all need it)."""
        if self._axes is None:
            self._axes = Axes(self)
        return self._axes

    @property
    def empty(self) -> bool:
        return not (len(self.trajectories) or len(self.learner) or len(self.metrics) or self.drift)


# trajectory columns the views use (ids and timings of a million trajectories are not read; `seq`, the
# task's stream position, is derived from the task id part by part: artifacts.read_part)
TRAJ_COLUMNS = ("family", "concept", "phase", "reward", "policy_version", "learner_version", "created_at",
                "finished_at", "seq")
CATEGORICAL = ("family", "concept")


def load_run(run_dir: str | Path, read_part: Callable[..., pd.DataFrame] = art.read_part) -> RunData:
    """Read a run directory (finished or being written); `read_part(path, columns, categorical)` may cache."""
    d = Path(run_dir)
    traj = art.read_table(d, "trajectories", lambda p: read_part(p, TRAJ_COLUMNS, CATEGORICAL))
    for col in CATEGORICAL:  # grouping a million rows by category codes, not strings
        if col in traj and not isinstance(traj[col].dtype, pd.CategoricalDtype):
            traj[col] = traj[col].astype("category")  # parts with different categories concatenate to str
    return RunData(name=d.name, trajectories=ad.sort_by(traj, "finished_at") if len(traj) else traj,
                   learner=art.standing(art.read_table(d, "learner", lambda p: read_part(p, None, ()))),
                   metrics=art.read_table(d, "metrics", lambda p: read_part(p, None, ())),
                   drift=[msgspec.to_builtins(e) for e in art.read_drift(d)], config=art.read_config(d),
                   summary=art.read_summary(d), samples=read_samples(d))


def start_time(run: RunData) -> float:
    """The run's first event time (the zero of the wall-time axis)."""
    candidates = []
    for df, col in ((run.trajectories, "created_at"), (run.trajectories, "finished_at"),
                    (run.learner, "time"), (run.metrics, "time")):
        if len(df) and col in df:
            v = pd.to_numeric(df[col], errors="coerce")
            v = v[v > 0]
            if len(v):
                candidates.append(float(v.min()))
    candidates += [float(e["time"]) for e in run.drift if e.get("time")]
    return min(candidates) if candidates else 0.0


class Axes:
    """Maps wall times to the three x-axes of one run."""

    def __init__(self, run: RunData):
        self.t0 = start_time(run)
        if len(run.trajectories) and "finished_at" in run.trajectories:
            self.traj_t = ad.sort_by(run.trajectories, "finished_at")["finished_at"].to_numpy(float)
            self.traj_n = np.arange(1, len(self.traj_t) + 1, dtype=float)
        else:  # live topics carry no trajectories: use the metrics' running count
            m = run.metrics
            ok = len(m) and {"time", "trajectories"} <= set(m.columns)
            m = m.sort_values("time") if ok else pd.DataFrame({"time": [], "trajectories": []})
            self.traj_t = m["time"].to_numpy(float)
            self.traj_n = np.maximum.accumulate(m["trajectories"].to_numpy(float)) if len(m) else np.zeros(0)
        self.step_t = np.sort(run.learner["time"].to_numpy(float)) if len(run.learner) else np.zeros(0)

    def traj_at(self, t) -> np.ndarray:
        k = np.searchsorted(self.traj_t, np.asarray(t, float), side="right")
        return np.where(k > 0, self.traj_n[np.maximum(k - 1, 0)] if len(self.traj_n) else 0, 0).astype(float)

    def step_at(self, t) -> np.ndarray:
        return np.searchsorted(self.step_t, np.asarray(t, float), side="right").astype(float)

    def add(self, df: pd.DataFrame, time_col: str) -> pd.DataFrame:
        t = df[time_col].to_numpy(float)
        return df.assign(x_time=t - self.t0, x_traj=self.traj_at(t), x_step=self.step_at(t))


def reward_frame(run: RunData, window: int, max_points: int = 4000) -> pd.DataFrame:
    """Online reward per family: windowed over W trajectories of the family (adaptation.online_reward),
    or, without trajectory rows (live topics), the metrics app's `metrics/reward` points.
    Long series are min/max-downsampled to about `max_points` (dashboard.downsample)."""
    axes = run.axes
    if len(run.trajectories):
        df = ad.online_reward(run.trajectories[["family", "reward", "finished_at"]], window, by="family")
        # thin to what a chart can show before mapping x: a million rows stay cheap
        df = downsample(df, "reward_w", by="family", max_points=max_points)
        df = axes.add(df, "finished_at")
        df["x_traj"] = df["n"].astype(float)
        return df.assign(run=run.name)[["run", "family", "reward_w", "x_time", "x_traj", "x_step"]]
    m = run.metrics
    if len(m) and "name" in m:
        pts = m[m["name"] == "metrics/reward"]
        if "concept" in pts:  # the metrics app emits {family, concept}, {family} and {} levels
            pts = pts[pts["concept"].isna()]
        pts = pts.sort_values("time")
        if len(pts):
            fam = pts["family"] if "family" in pts else pd.Series("all", index=pts.index)
            df = axes.add(pts.assign(family=fam.fillna("all"), reward_w=pts["value"]), "time")
            if "learner_step" in pts and (pts["learner_step"] > 0).any():
                df["x_step"] = pts["learner_step"].to_numpy(float)
            df["x_traj"] = pts["trajectories"].to_numpy(float)
            return df.assign(run=run.name)[["run", "family", "reward_w", "x_time", "x_traj", "x_step"]]
    return pd.DataFrame(columns=["run", "family", "reward_w", "x_time", "x_traj", "x_step"])


def recovery_frame(run: RunData, window: int, delta: float) -> pd.DataFrame:
    """Recovery of every (drift event, family): adaptation.drift_recoveries, as in summary.json (on
    stream positions; without trajectory rows, e.g. live topics, every changed family is "no data"). A run
    without its summary is still being written: its last block's not-yet-recovered records are "in progress"."""
    rec = ad.drift_recoveries(run.trajectories, run.drift, run.learner, window, delta)
    return (rec if run.summary else ad.in_open_block(rec)).assign(run=run.name)


def drift_marks(run: RunData) -> pd.DataFrame:
    """One mark per drift event, labelled with its phase name, when it reached the agents: the first
    finish of a trajectory of its block (adaptation.drift_times), not its publish time."""
    times = ad.drift_times(run.trajectories, run.drift)
    rows = [{"run": run.name, "phase": e["phase"], "time": t, "label": e.get("name") or f"phase {e['phase']}"}
            for e, t in zip(run.drift, times)]
    df = pd.DataFrame(rows, columns=["run", "phase", "time", "label"])
    return run.axes.add(df, "time") if len(df) else df.assign(x_time=[], x_traj=[], x_step=[])


def learner_metrics(run: RunData, view: str) -> pd.DataFrame:
    """Long frame (run, metric, value, x_*) of the learner columns a view shows (see VIEW_METRICS)."""
    pat = re.compile(VIEW_METRICS[view])
    cols = [c for c in run.learner.columns if pat.match(str(c).rsplit("/", 1)[-1])] if len(run.learner) else []
    if not cols:
        return pd.DataFrame(columns=["run", "metric", "value", "x_time", "x_traj", "x_step"])
    df = run.axes.add(run.learner.sort_values("time"), "time")
    long = df.melt(id_vars=["x_time", "x_traj", "x_step"], value_vars=cols, var_name="metric", value_name="value")
    return long.dropna(subset=["value"]).assign(run=run.name)


def staleness_counts(run: RunData) -> pd.DataFrame:
    """Trajectories per staleness value: from the trajectory rows (learner version at training time
    minus behaviour version) when known, else from the learner events' histograms."""
    t = run.trajectories
    vals = np.zeros(0)
    if len(t) and "learner_version" in t and t["learner_version"].notna().any():
        vals = (t["learner_version"] - t["policy_version"]).dropna().to_numpy(float)
    elif len(run.learner) and "staleness" in run.learner:
        hists = (json.loads(s) if isinstance(s, str) else s for s in run.learner["staleness"])
        vals = ad.staleness_from_histograms(hists)
    if not vals.size:
        return pd.DataFrame(columns=["run", "staleness", "count"])
    s, c = np.unique(vals.astype(int), return_counts=True)
    return pd.DataFrame({"run": run.name, "staleness": s, "count": c})


def throughput(run: RunData, bucket_s: float = 5.0) -> pd.DataFrame:
    """Long frame of trajectories/s (finish times bucketed by `bucket_s`) and learner tokens/s
    (each step's tokens over the time since the previous step)."""
    axes = run.axes
    frames = []
    if len(run.trajectories):
        t = run.trajectories["finished_at"].to_numpy(float)
        t_min = float(np.nanmin(t))
        counts = np.bincount(((t[~np.isnan(t)] - t_min) // bucket_s).astype(np.int64))
        edges = np.flatnonzero(counts)
        tt = t_min + (edges + 1) * bucket_s  # bucket end
        frames.append(axes.add(pd.DataFrame({"time": tt, "metric": "trajectories/s",
                                             "value": counts[edges] / bucket_s}), "time"))
    elif len(run.metrics) and "name" in run.metrics:  # live topics: the metrics app's overall rate
        m = run.metrics[run.metrics["name"] == "metrics/throughput"]
        if "family" in m:
            m = m[m["family"].isna()]
        if len(m):
            frames.append(axes.add(pd.DataFrame({"time": m["time"].to_numpy(float), "metric": "trajectories/s",
                                                 "value": m["value"].to_numpy(float)}), "time"))
    if len(run.learner) >= 2:
        lr = run.learner.sort_values("time")
        dt = lr["time"].diff().to_numpy(float)
        tok = lr["n_tokens"].to_numpy(float) / np.where(dt > 0, dt, np.nan)
        frames.append(axes.add(pd.DataFrame({"time": lr["time"].to_numpy(float)[1:], "metric": "learner tokens/s",
                                             "value": tok[1:]}), "time"))
    if not frames:
        return pd.DataFrame(columns=["run", "metric", "value", "x_time", "x_traj", "x_step"])
    return pd.concat(frames, ignore_index=True).dropna(subset=["value"]).assign(run=run.name)


def eval_frame(run: RunData) -> pd.DataFrame:
    """Eval reward per concept: `eval/reward` metric points labelled with a concept (the held-out evaluator's)."""
    ev = art.eval_points(run.metrics)
    if not len(ev):
        return pd.DataFrame(columns=["run", "concept", "value", "x_time", "x_traj", "x_step"])
    df = run.axes.add(ev.sort_values("time"), "time")
    if "family" in df:
        df["concept"] = df["family"].fillna("") + "/" + df["concept"].astype(str)
    return df.assign(run=run.name)


FORGETTING_VIEW = ["run", "family", "concept", "left_phase", "recurs_phase", "before", "after", "forgetting",
                   "n_before", "n_after"]


def forgetting_frame(run: RunData, window: int) -> pd.DataFrame:
    """Forgetting of each recurring concept: adaptation.forgetting, as in summary.json (online reward on
    the stream's drift blocks; without trajectory rows, e.g. live topics, none)."""
    if not run.drift or not len(run.trajectories):
        return pd.DataFrame(columns=FORGETTING_VIEW)
    return ad.forgetting(run.trajectories, run.drift, window).assign(run=run.name)[FORGETTING_VIEW]


def run_signature(run_dir: str | Path) -> tuple:
    """(name, mtime, size) of every file the dashboard reads: changes whenever the run does."""
    d = Path(run_dir)
    files = [f for t in art.TABLES for f in art.table_files(d, t)]
    files += [d / n for n in ("drift.jsonl", "summary.json", "config.json", SAMPLES_FILE)]
    sig = []
    for f in files:
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        sig.append((f.name, st.st_mtime_ns, st.st_size))
    return tuple(sig)


ANSWER_COLUMNS = ["run", "family", "concept", "prompt", "answer", "reward", "version", "phase"]  # text first


def answers_frame(run: RunData, n: int = 3, prompt_chars: int = 60) -> pd.DataFrame:
    """The `n` latest answers of each (family, concept) as text, newest first (the prompt's end: its question)."""
    latest = latest_per_key(run.samples, n, lambda s: (s.family, s.concept))
    rows = [{"run": run.name, "family": s.family, "concept": s.concept, "phase": s.phase, "version": s.policy_version,
             "reward": s.reward, "prompt": s.prompt[-prompt_chars:] if s.decoded else "(no text)",
             "answer": s.answer if s.decoded else "(no text)", "seq": s.seq} for s in latest]
    if not rows:
        return pd.DataFrame(columns=ANSWER_COLUMNS)
    df = pd.DataFrame(rows).sort_values(["family", "concept", "seq"], ascending=[True, True, False])
    return df[ANSWER_COLUMNS].reset_index(drop=True)


def _steps_seen(run: RunData, state: str) -> pd.DataFrame:
    """The learner steps to set against the trajectories read so far: while a run is written, those up to its newest
    trajectory (the learner's table can be flushed ahead of the trajectories', which read as more than 100%)."""
    if state == "finished" or not len(run.trajectories) or "time" not in run.learner:
        return run.learner
    return run.learner[run.learner["time"] <= run.trajectories["finished_at"].max()]


def header_values(run: RunData, window: int, staleness: pd.DataFrame) -> dict[str, Any]:
    n_traj = len(run.trajectories)
    if not n_traj and len(run.metrics) and "trajectories" in run.metrics:  # live topics: the metrics' count
        n_traj = int(run.metrics["trajectories"].max())
    auc = ad.auc(run.trajectories["reward"].to_numpy(float), window) if len(run.trajectories) else None
    mean = (float((staleness["staleness"] * staleness["count"]).sum() / staleness["count"].sum())
            if len(staleness) else None)
    state = "finished" if run.summary else "live topics" if run.name.startswith("live:") else "being written"
    return {"name": run.name, "state": state, "trajectories": n_traj, "learner_steps": len(run.learner),
            "auc": auc, "drift_events": len(run.drift), "mean_staleness": mean,
            "trained_fraction": _finite_or_none(ad.trained_fraction(_steps_seen(run, state), n_traj)),
            "busy_share": _finite_or_none(ad.learner_busy_share(run.learner)),
            "dead_letters": (_over_run(run.learner, "learner/dead_letters", "learner/dead_letters"),
                             _point_over_run(run.metrics, "metrics/dlq"))}


def _over_run(df: pd.DataFrame, column: str, name: str) -> int | None:
    """Metric `name` (the values of `column`) reduced over the run as declared (`reductions`: dead letters
    are running totals, so their last value); None when the run has none."""
    if column not in df:
        return None
    v = reduce_values(name, pd.to_numeric(df[column], errors="coerce"))
    return int(v) if not math.isnan(v) else None


def _point_over_run(metrics: pd.DataFrame, name: str) -> int | None:
    if not len(metrics) or "name" not in metrics:
        return None
    return _over_run(metrics[metrics["name"] == name], "value", name)


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def run_frames(run: RunData, window: int, delta: float) -> dict[str, Any]:
    """Every view's frame for one run (what the page shows, before downsampling for the charts)."""
    rec = recovery_frame(run, window, delta)
    stal = staleness_counts(run)
    out: dict[str, Any] = {"recovery": rec, "recovery_summary": ad.recovery_summary(rec),
                           "reward": reward_frame(run, window), "marks": drift_marks(run), "eval": eval_frame(run),
                           "forgetting": forgetting_frame(run, window), "staleness": stal,
                           "throughput": throughput(run), "answers": answers_frame(run)}
    for view in VIEW_METRICS:
        out[view] = learner_metrics(run, view)
    for key, y in (("throughput", "value"), *((v, "value") for v in VIEW_METRICS)):
        # thinned once here (the charts thin further): a page refresh then handles ~2,000 rows a view
        if len(out[key]) > 2000:
            out[key] = downsample(out[key], y, by="metric", max_points=2000)
    out["header"] = header_values(run, window, stal)
    return out

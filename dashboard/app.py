"""SAO Lab dashboard: `streamlit run dashboard/app.py -- --runs runs/ [--bootstrap HOST:PORT --run NAME]`.

Read-only. Opens runs under the runs directory (finished or being written) and optionally tails a
live run's topics. The sidebar's selections live in `st.session_state` (keys below), outside the
fragment that re-renders the views every few seconds, so a refresh never loses them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import charts, data
from dashboard.live import LiveTap
from streamer import artifacts as art
from streamer.adaptation import DEFAULT_DELTA, DEFAULT_WINDOW


def cli_options(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dashboard/app.py", allow_abbrev=False, add_help=False)
    p.add_argument("--runs", default=os.environ.get("SAO_RUNS_DIR", "runs"))
    p.add_argument("--bootstrap", default=os.environ.get("SAO_BOOTSTRAP", ""))
    p.add_argument("--run", default="")
    p.add_argument("--refresh", type=float, default=3.0)
    return p.parse_known_args(argv)[0]  # unknown arguments (a test runner's) are not ours


@st.cache_resource(max_entries=20000, show_spinner=False)
def _part(path: str, mtime_ns: int, size: int) -> pd.DataFrame:
    # parts never change once renamed into place: cache each by (path, mtime, size), shared, not copied
    return art._read_part(Path(path))


def _cached_part(path: Path) -> pd.DataFrame:
    s = path.stat()
    return _part(str(path), s.st_mtime_ns, s.st_size)


@st.cache_resource(show_spinner=False)
def _tap(bootstrap: str, run: str) -> LiveTap:
    return LiveTap(bootstrap, run)


def sidebar(opts: argparse.Namespace) -> None:
    ss = st.session_state
    for key, value in (("runs_root", opts.runs), ("bootstrap", opts.bootstrap), ("live_run", opts.run),
                       ("x_axis", "wall time (s)"), ("window", DEFAULT_WINDOW), ("delta", DEFAULT_DELTA),
                       ("auto_refresh", True), ("refresh_s", float(opts.refresh))):
        ss.setdefault(key, value)
    sb = st.sidebar
    sb.text_input("runs directory", key="runs_root")
    names = [p.name for p in art.list_runs(ss["runs_root"])]
    if "runs" not in ss:
        ss["runs"] = names[:1]
    ss["runs"] = [r for r in ss["runs"] if r in names]  # a run deleted meanwhile
    sb.multiselect("runs (side by side)", names, key="runs")
    sb.radio("x-axis", list(data.X_AXES), key="x_axis")
    sb.number_input("reward window W (trajectories)", min_value=1, step=1, key="window")
    sb.number_input("recovery tolerance δ (relative)", min_value=0.0, max_value=1.0, step=0.05, key="delta")
    sb.toggle("live refresh", key="auto_refresh")
    sb.number_input("refresh every (s)", min_value=1.0, step=1.0, key="refresh_s")
    with sb.expander("live topics (broker)", expanded=bool(ss["bootstrap"] and ss["live_run"])):
        st.text_input("bootstrap servers", key="bootstrap", placeholder="127.0.0.1:9092")
        st.text_input("run (topic prefix)", key="live_run")


def load_runs() -> list[data.RunData]:
    ss = st.session_state
    runs = []
    for name in ss["runs"]:
        try:
            runs.append(data.load_run(Path(ss["runs_root"]) / name, read_part=_cached_part))
        except (art.ArtifactError, OSError) as e:
            st.error(f"run '{name}': {e}")
    if ss["bootstrap"] and ss["live_run"]:
        try:
            tap = _tap(ss["bootstrap"], ss["live_run"])
        except ValueError as e:  # a bad run name
            st.error(f"live topics: {e}")
        else:
            (st.success if tap.ok else st.warning)(tap.status)
            snap = tap.snapshot()
            if not snap.empty:
                runs.append(snap)
    return runs


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def views() -> None:
    ss = st.session_state
    runs = load_runs()
    if not runs:
        st.info(f"No run selected. Runs are read from '{ss['runs_root']}' (pick one in the sidebar), "
                "or give a broker and a run name for live topics.")
        return
    x_title, window, delta = ss["x_axis"], int(ss["window"]), float(ss["delta"])
    x_col = data.X_AXES[x_title]
    header(runs, window)
    recs = [data.recovery_frame(r, window, delta) for r in runs]

    st.subheader("Online reward per family")
    reward = _concat([data.reward_frame(r, window) for r in runs])
    marks = _concat([data.drift_marks(r) for r in runs])
    spans = _concat([data.recovery_spans(r, rec) for r, rec in zip(runs, recs)])
    if len(reward):
        st.altair_chart(charts.reward_chart(reward, marks, spans, x_col, x_title), width="stretch",
                        key="reward_chart")
    else:
        st.info("No trajectories or reward metrics yet.")

    st.subheader("Drift events and recovery")
    rec = _concat(recs)
    if len(rec):
        cols = [c for c in ("run", "phase", "name", "family", "prev_concept", "concept", "pre_level", "trajectories",
                            "learner_steps", "censored") if c in rec]
        st.dataframe(rec[cols], hide_index=True, key="drift_table")
    else:
        st.info("No drift events.")

    st.subheader("Eval reward per concept")
    ev = _concat([data.eval_frame(r) for r in runs])
    if len(ev):
        st.altair_chart(charts.lines_chart(ev, x_col, x_title, "eval reward", ["run", "concept"], name="eval"),
                        width="stretch", key="eval_chart")
        fg = _concat([data.forgetting_frame(r) for r in runs])
        if len(fg):
            st.caption("Forgetting: eval reward when a concept recurs minus its last value before it left")
            st.dataframe(fg, hide_index=True, key="forgetting_table")
    else:
        st.info("No eval/reward metrics.")

    left, right = st.columns(2)
    with left:
        st.subheader("Staleness")
        stal = _concat([data.staleness_counts(r) for r in runs])
        _chart_or_info(stal, lambda: charts.staleness_chart(stal), "staleness_chart", "No staleness data.")
    with right:
        _metric_view(runs, "clip", "Masked / clipped token fractions", "fraction of tokens", x_col, x_title)
    left, right = st.columns(2)
    with left:
        _metric_view(runs, "value", "Value loss and explained variance", "value", x_col, x_title)
    with right:
        _metric_view(runs, "kl_entropy", "KL and entropy", "value", x_col, x_title)
    left, right = st.columns(2)
    with left:
        st.subheader("Throughput")
        tp = _concat([data.throughput(r) for r in runs])
        _chart_or_info(tp, lambda: charts.lines_chart(tp, x_col, x_title, "per second", ["run", "metric"],
                                                      name="throughput"), "throughput_chart", "No throughput data.")
    with right:
        _metric_view(runs, "idle", "Learner idle time", "idle", x_col, x_title)


def _chart_or_info(df: pd.DataFrame, build, key: str, empty: str) -> None:
    if len(df):
        st.altair_chart(build(), width="stretch", key=key)
    else:
        st.info(empty)


def _metric_view(runs, view: str, title: str, y_title: str, x_col: str, x_title: str) -> None:
    st.subheader(title)
    df = _concat([data.learner_metrics(r, view) for r in runs])
    _chart_or_info(df, lambda: charts.lines_chart(df, x_col, x_title, y_title, ["run", "metric"], name=view),
                   f"{view}_chart", f"No {title.lower()} in the learner events.")


def header(runs: list[data.RunData], window: int) -> None:
    for r in runs:
        traj = r.trajectories
        state = "finished" if r.summary else "live topics" if r.name.startswith("live:") else "being written"
        st.markdown(f"**{r.name}** ({state})")
        cols = st.columns(5)
        n_traj = len(traj)
        if not n_traj and len(r.metrics) and "trajectories" in r.metrics:  # live topics: the metrics' count
            n_traj = int(r.metrics["trajectories"].max())
        cols[0].metric("trajectories", f"{n_traj:,}")
        cols[1].metric("learner steps", f"{len(r.learner):,}")
        auc = float(data.ad.auc(traj.sort_values("finished_at")["reward"].to_numpy(float), window)) if len(traj) else None
        cols[2].metric(f"AUC (W={window})", "–" if auc is None else f"{auc:.3f}")
        cols[3].metric("drift events", str(len(r.drift)))
        stal = data.staleness_counts(r)
        mean = (stal["staleness"] * stal["count"]).sum() / stal["count"].sum() if len(stal) else None
        cols[4].metric("mean staleness", "–" if mean is None else f"{mean:.2f}")


def main() -> None:
    st.set_page_config(page_title="SAO Lab", layout="wide")
    st.title("SAO Lab: adaptation under drift")
    sidebar(cli_options(sys.argv[1:]))
    ss = st.session_state
    every = float(ss["refresh_s"]) if ss["auto_refresh"] else None
    st.fragment(run_every=every)(views)()


if __name__ == "__main__":  # `streamlit run` and AppTest execute the script as __main__
    main()

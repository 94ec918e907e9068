"""SAO Lab dashboard: `streamlit run dashboard/app.py -- --runs runs/ [--bootstrap HOST:PORT --run NAME]`.

Open `http://127.0.0.1:8501/?run=a&run=b` to start with runs a and b side by side.

Read-only. Opens runs inside the runs directory (finished or being written) and optionally tails a
live run's topics. What it reads and where it connects are the operator's settings (dashboard.access:
a visitor picks runs inside the root, and types a broker only under --allow-any-broker). The sidebar's
selections live in `st.session_state` (keys below), outside the fragment that re-renders the views
every few seconds, so a refresh never loses them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import access, charts, data, live
from dashboard.access import DashboardSettings
from streamer.runs import artifacts as art
from streamer.runs.adaptation import DEFAULT_DELTA, DEFAULT_WINDOW


@st.cache_resource(max_entries=20000, show_spinner=False)
def _part(path: str, mtime_ns: int, size: int, columns: tuple[str, ...] | None,
          categorical: tuple[str, ...]) -> pd.DataFrame:
    # parts never change once renamed into place: cache each by (path, mtime, size), shared, not copied
    return art.read_part(Path(path), columns, categorical)


def _cached_part(path: Path, columns, categorical) -> pd.DataFrame:
    s = path.stat()
    return _part(str(path), s.st_mtime_ns, s.st_size, tuple(columns) if columns else None, tuple(categorical))


def sidebar(cfg: DashboardSettings) -> None:
    ss = st.session_state
    for key, value in (("bootstrap", cfg.bootstrap), ("live_run", cfg.run),
                       ("x_axis", "wall time (s)"), ("window", DEFAULT_WINDOW), ("delta", DEFAULT_DELTA),
                       ("auto_refresh", True), ("refresh_s", float(cfg.refresh))):
        ss.setdefault(key, value)
    sb = st.sidebar
    sb.caption(f"runs directory: {Path(cfg.runs).resolve()}")
    names = access.list_runs(cfg.runs)
    asked = st.query_params.get_all("run")
    for name in asked:
        if name not in names:
            sb.warning(_not_offered(cfg.runs, name))
    if "runs" not in ss:  # first run of a session: `?run=a&run=b` in the URL, the live run's directory, the newest
        wanted = [r for r in asked if r in names]
        ss["runs"] = wanted or ([cfg.run] if cfg.run in names else names[:1])
    ss["runs"] = [r for r in ss["runs"] if r in names]  # a run deleted meanwhile
    sb.multiselect("runs (side by side)", names, key="runs")
    sb.radio("x-axis", list(data.X_AXES), key="x_axis")
    sb.number_input("reward window W (trajectories)", min_value=1, max_value=1_000_000, step=1, key="window")
    sb.number_input("recovery tolerance δ (relative)", min_value=0.0, max_value=1.0, step=0.05, key="delta")
    sb.toggle("live refresh", key="auto_refresh")
    sb.number_input("refresh every (s)", min_value=1.0, step=1.0, key="refresh_s")
    if cfg.allow_any_broker:  # the operator let visitors choose where the server connects
        with sb.expander("live topics (broker)", expanded=bool(ss["bootstrap"] and ss["live_run"])):
            st.text_input("bootstrap servers", key="bootstrap", placeholder="127.0.0.1:9092")
            st.text_input("run (topic prefix)", key="live_run")
    elif cfg.bootstrap and cfg.run:
        sb.caption(f"live topics: run '{cfg.run}' on {cfg.bootstrap}")


def _not_offered(root: str, name: str) -> str:
    try:
        access.run_dir(root, name)
    except access.Refused as e:
        return str(e)
    return f"run {name!r}: no such run in {Path(root).resolve()}"


@st.cache_resource(max_entries=64, show_spinner=False)
def _frames(run_dir: str, signature: tuple, window: int, delta: float) -> dict:
    # a run's view frames are recomputed only when one of its files changed (`signature`)
    return data.run_frames(data.load_run(run_dir, read_part=_cached_part), window, delta)


def load_frames(cfg: DashboardSettings, window: int, delta: float) -> list[dict]:
    """The view frames of every selected run, and of the live topics when a broker is given."""
    ss = st.session_state
    out = []
    for name in ss["runs"]:
        try:
            run_dir = access.run_dir(cfg.runs, name)
            out.append(_frames(str(run_dir), data.run_signature(run_dir), window, delta))
        except access.Refused as e:
            st.error(str(e))
        except (art.ArtifactError, OSError) as e:
            st.error(f"run '{name}': {e}")
    bootstrap, live_run = cfg.live_target(ss["bootstrap"], ss["live_run"])
    if bootstrap and live_run and live_run in ss["runs"]:
        # `sao up` records the run's topics into runs/<run>/ as well: its files hold everything (the
        # trajectories too), so the topics would only show the same run twice
        st.caption(f"Run '{live_run}' is read from its directory (written live); its topics are not tailed.")
    elif bootstrap and live_run:
        try:
            tap = live.shared_taps(cfg.max_live).get(access.check_broker(bootstrap), access.check_live_run(live_run))
        except access.Refused as e:
            st.error(f"live topics: {e}")
        except live.ReadersBusy as e:
            st.warning(f"live topics: {e}")
        else:
            (st.success if tap.ok else st.warning)(tap.status)
            snap = tap.snapshot()
            if not snap.empty:
                out.append(data.run_frames(snap, window, delta))
    return out


def _concat(frames: list[dict], key: str) -> pd.DataFrame:
    parts = [f[key] for f in frames if len(f[key])]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def views(cfg: DashboardSettings) -> None:
    ss = st.session_state
    x_title, window, delta = ss["x_axis"], int(ss["window"]), float(ss["delta"])
    frames = load_frames(cfg, window, delta)
    if not frames:
        st.info(f"No run selected. Runs are read from '{cfg.runs}' (pick one in the sidebar)"
                + (", or give a broker and a run name for live topics." if cfg.allow_any_broker else "."))
        return
    x_col = data.X_AXES[x_title]
    header([f["header"] for f in frames], window)

    left, right = st.columns([3, 2])
    with left:
        st.subheader("Online reward per family")
        reward = _concat(frames, "reward")
        if len(reward):
            chart = charts.reward_chart(reward, _concat(frames, "marks"), x_col, x_title)
            st.altair_chart(chart, width="stretch", key="reward_chart")
        else:
            st.info("No trajectories or reward metrics yet.")
    with right:
        answers_table(_concat(frames, "answers"))

    st.subheader("Drift events and recovery")
    rec = _concat(frames, "recovery")
    if len(rec):
        recovery_table(rec, {f["header"]["name"]: f["recovery_summary"] for f in frames}, window, delta)
    else:
        st.info("No drift events.")
    fg = _concat(frames, "forgetting")
    if len(fg):
        st.caption(f"Forgetting of a concept rewarded again: the online reward of its first W={window} trajectories "
                   f"of the family after it comes back minus that of its last W before it left (the task stream's "
                   f"order); negative = forgotten")
        st.dataframe(fg, hide_index=True, key="forgetting_table")

    st.subheader("Eval reward per concept")
    ev = _concat(frames, "eval")
    if len(ev):
        st.altair_chart(charts.lines_chart(ev, x_col, x_title, "eval reward", ["run", "concept"], name="eval"),
                        width="stretch", key="eval_chart")
    else:
        st.info("No eval/reward metrics.")

    left, right = st.columns(2)
    with left:
        st.subheader("Staleness")
        stal = _concat(frames, "staleness")
        _chart_or_info(stal, lambda: charts.staleness_chart(stal), "staleness_chart", "No staleness data.")
    with right:
        _metric_view(frames, "clip", "Masked / clipped token fractions", "fraction of tokens", x_col, x_title)
    left, right = st.columns(2)
    with left:
        _metric_view(frames, "value_loss", "Value loss", "value loss", x_col, x_title)
    with right:  # early in a run the critic's EV can be -25: on one axis with the loss it hid both
        _metric_view(frames, "explained_variance", "Explained variance (below -1 drawn at -1)", "explained variance",
                     x_col, x_title, y_domain=(-1.0, 1.0))
    left, right = st.columns(2)
    with left:
        _metric_view(frames, "kl_entropy", "KL and entropy", "value", x_col, x_title)
    with right:  # a fall of the importance weights' ESS comes before a collapse of asynchronous RL
        _metric_view(frames, "ess", "Effective sample size of the importance weights", "ESS / tokens", x_col,
                     x_title)
    tp = _concat(frames, "throughput")
    for column, (metric, title) in zip(st.columns(2), (("trajectories/s", "Trajectories per second"),
                                                       ("learner tokens/s", "Learner tokens per second"))):
        with column:  # apart: tokens/s is ~20x trajectories/s
            _lines_view(tp[tp["metric"] == metric] if len(tp) else tp, metric.replace(" ", "_").replace("/", "_per_"),
                        title, "per second", x_col, x_title, f"No {metric} data.")
    left, _ = st.columns(2)
    with left:
        _metric_view(frames, "idle", "Learner idle time", "idle", x_col, x_title)


def answers_table(answers: pd.DataFrame) -> None:
    """The latest answers of each concept as text (samples.jsonl, `sao samples RUN` prints more)."""
    st.subheader("Latest answers per concept")
    if not len(answers):
        st.info("No answers sampled yet (runs/<run>/samples.jsonl).")
        return
    cols = [c for c in data.ANSWER_COLUMNS if c != "run" or answers["run"].nunique() > 1]
    st.dataframe(answers[cols], hide_index=True, key="answers_table",
                 column_config={"reward": st.column_config.NumberColumn(format="%.2f")})


def _chart_or_info(df: pd.DataFrame, build, key: str, empty: str) -> None:
    if len(df):
        st.altair_chart(build(), width="stretch", key=key)
    else:
        st.info(empty)


def _lines_view(df: pd.DataFrame, key: str, title: str, y_title: str, x_col: str, x_title: str, empty: str,
                y_domain: tuple[float, float] | None = None) -> None:
    st.subheader(title)
    _chart_or_info(df, lambda: charts.lines_chart(df, x_col, x_title, y_title, ["run", "metric"], name=key,
                                                  y_domain=y_domain), f"{key}_chart", empty)


def _metric_view(frames: list[dict], view: str, title: str, y_title: str, x_col: str, x_title: str,
                 y_domain: tuple[float, float] | None = None) -> None:
    _lines_view(_concat(frames, view), view, title, y_title, x_col, x_title,
                f"No {title.lower()} in the learner events.", y_domain)


RECOVERY_COLUMNS = {"run": "run", "phase": "phase", "name": "name", "family": "family", "prev_concept": "from",
                    "concept": "to", "status": "status", "pre_level": "pre-drift level",
                    "initial_level": "initial level", "trajectories": "recovery (family trajectories)",
                    "stream_trajectories": "recovery (stream trajectories)",
                    "learner_steps": "recovery (policy steps)", "low_pre_level": "low pre-drift level"}


def recovery_table(rec: pd.DataFrame, summaries: dict[str, dict], window: int, delta: float) -> None:
    """One row per (drift event, family), with the counts per status (adaptation.drift_recoveries)."""
    st.caption(f"Per family, on the task stream's order: levels are mean rewards over W={window} trajectories of the "
               f"family (the last before the drift, the first after it); recovered = a later window back within "
               f"δ={delta:g} of the pre-drift level, from a policy updated after the drift; censored = not back "
               "before the block ended (counted, never averaged); in progress = not back yet in a block that has "
               "not ended (a run being written). Recovery in trajectories is a lower bound when censored.")
    for name, s in summaries.items():
        counts = "  ·  ".join(f"{k}: {v}" for k, v in s["by_status"].items() if v)
        st.caption(f"{name}: {counts}" if len(summaries) > 1 else counts)
    cols = [c for c in RECOVERY_COLUMNS if c in rec and (c != "run" or rec["run"].nunique() > 1)]
    st.dataframe(rec[cols].rename(columns=RECOVERY_COLUMNS), hide_index=True, key="drift_table")


def header(values: list[dict], window: int) -> None:
    for h in values:
        st.markdown(f"**{h['name']}** ({h['state']})")
        cols = st.columns(8)
        cols[0].metric("trajectories", f"{h['trajectories']:,}")
        cols[1].metric("learner steps", f"{h['learner_steps']:,}")
        cols[2].metric(f"AUC (W={window})", _fmt(h["auc"], "{:.3f}"))
        cols[3].metric("drift events", str(h["drift_events"]))
        cols[4].metric("mean staleness", _fmt(h["mean_staleness"], "{:.2f}"))
        cols[5].metric("trained fraction", _fmt(h["trained_fraction"], "{:.0%}"),
                       help="trajectories the learner trained on ÷ trajectories generated (while a run is "
                       "written: its steps up to the newest trajectory read)")
        cols[6].metric("learner busy share", _fmt(h["busy_share"], "{:.0%}"),
                       help="1 − the learner's idle time (waiting for a batch) ÷ its wall time")
        learner, metrics = h["dead_letters"]
        cols[7].metric("dead letters", " · ".join("–" if v is None else f"{v:,}" for v in (learner, metrics)),
                       help="messages sent to <run>.dlq with the reason: by the learner · by the metrics app")


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else spec.format(v)


def main() -> None:
    st.set_page_config(page_title="SAO Lab", layout="wide")
    st.title("SAO Lab: adaptation under drift")
    cfg = access.settings_from_args(sys.argv[1:])
    sidebar(cfg)
    ss = st.session_state
    every = float(ss["refresh_s"]) if ss["auto_refresh"] and anything_live(cfg) else None
    st.fragment(run_every=every)(views)(cfg)


def anything_live(cfg: DashboardSettings) -> bool:
    """A selected run without its summary (still being written), or live topics: worth refreshing."""
    ss = st.session_state
    unfinished = any(not _finished(cfg.runs, r) for r in ss["runs"])
    bootstrap, live_run = cfg.live_target(ss["bootstrap"], ss["live_run"])
    return unfinished or bool(bootstrap and live_run and live_run not in ss["runs"])


def _finished(root: str, name: str) -> bool:
    try:
        return (access.run_dir(root, name) / "summary.json").exists()
    except access.Refused:
        return True  # not ours to read: nothing to refresh


if __name__ == "__main__":  # `streamlit run` and AppTest execute the script as __main__
    main()

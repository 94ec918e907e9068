"""Altair (Vega-Lite) chart builders: a view frame in, a chart out (no Streamlit, no I/O).

Charts render as SVG (`usermeta.embedOptions`), so the browser test can find the drift marks by
their mark names (`drift_rules`, `drift_labels`) in the page.
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from dashboard.downsample import downsample

SVG = {"embedOptions": {"renderer": "svg", "actions": False}}
HEIGHT = 260


def _x(x_col: str, title: str) -> alt.X:
    return alt.X(f"{x_col}:Q", title=title)


def series_label(df: pd.DataFrame, cols: list[str]) -> pd.Series:
    """One legend entry per line: the run name is left out when a single run is shown."""
    use = [c for c in cols if c != "run" or df["run"].nunique() > 1]
    return df[use].astype(str).agg(" · ".join, axis=1) if use else pd.Series("", index=df.index)


def reward_chart(reward: pd.DataFrame, marks: pd.DataFrame, x_col: str, x_title: str,
                 max_points: int = 2000) -> alt.LayerChart:
    """Online reward per family (per run), with a dashed rule and a label at each drift event."""
    df = reward.assign(series=series_label(reward, ["run", "family"])) if len(reward) else reward.assign(series=[])
    df = downsample(df, "reward_w", by="series", max_points=max_points)
    lines = alt.Chart(df[[x_col, "reward_w", "series"]], name="reward_lines").mark_line(interpolate="linear").encode(
        x=_x(x_col, x_title), y=alt.Y("reward_w:Q", title="online reward (windowed)", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("series:N", title=None), tooltip=["series:N", f"{x_col}:Q", "reward_w:Q"])
    layers = [lines]
    if len(marks):
        m = marks.assign(series=series_label(marks, ["run"]))
        m["text"] = m["label"] if m["run"].nunique() <= 1 else m["run"] + ": " + m["label"]
        base = alt.Chart(m[[x_col, "text"]])
        layers.append(base.mark_rule(strokeDash=[6, 4], color="#d62728", size=1.5).encode(
            x=alt.X(f"{x_col}:Q"), tooltip=["text:N"]).properties(name="drift_rules"))
        layers.append(base.mark_text(align="left", baseline="top", angle=0, dx=4, dy=4, fontSize=11,
                                     color="#d62728").encode(
            x=alt.X(f"{x_col}:Q"), y=alt.value(4), text="text:N").properties(name="drift_labels"))
    return alt.layer(*layers).properties(height=HEIGHT + 60, usermeta=SVG)


def lines_chart(df: pd.DataFrame, x_col: str, x_title: str, y_title: str, color_cols: list[str],
                max_points: int = 2000, name: str = "lines") -> alt.Chart:
    d = df.assign(series=series_label(df, color_cols)) if len(df) else df.assign(series=[])
    d = downsample(d, "value", by="series", max_points=max_points)
    return alt.Chart(d[[x_col, "value", "series"]], name=name).mark_line().encode(
        x=_x(x_col, x_title), y=alt.Y("value:Q", title=y_title), color=alt.Color("series:N", title=None),
        tooltip=["series:N", f"{x_col}:Q", "value:Q"]).properties(height=HEIGHT, usermeta=SVG)


def staleness_chart(counts: pd.DataFrame) -> alt.Chart:
    d = counts.assign(series=series_label(counts, ["run"])) if len(counts) else counts.assign(series=[])
    return alt.Chart(d, name="staleness_bars").mark_bar().encode(
        x=alt.X("staleness:O", title="staleness (learner version − behaviour version)"),
        y=alt.Y("count:Q", title="trajectories"), color=alt.Color("series:N", title=None),
        xOffset="series:N", tooltip=["series:N", "staleness:O", "count:Q"]).properties(height=HEIGHT, usermeta=SVG)

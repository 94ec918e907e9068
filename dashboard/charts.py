"""Altair (Vega-Lite) chart builders: a view frame in, a chart out (no Streamlit, no I/O).

The reward chart renders as SVG (`usermeta.embedOptions`), so the browser test can find its lines and drift marks
by their mark names (`reward_lines`, `drift_rules`, `drift_labels`) in the page; the others draw on canvas
(cheaper for the browser, and what a screenshot tool waiting for a drawn chart looks for).
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from dashboard.downsample import downsample

SVG = {"embedOptions": {"renderer": "svg", "actions": False}}
CANVAS = {"embedOptions": {"renderer": "canvas", "actions": False}}
HEIGHT = 260
DRIFT = "#d62728"


def _x(x_col: str, title: str) -> alt.X:
    return alt.X(f"{x_col}:Q", title=title)


def series_label(df: pd.DataFrame, cols: list[str]) -> pd.Series:
    """One legend entry per line: the run name is left out when a single run is shown."""
    use = [c for c in cols if c != "run" or df["run"].nunique() > 1]
    if not use:
        return pd.Series("", index=df.index)
    out = df[use[0]].astype(str)
    for c in use[1:]:  # vectorised: a row-wise join costs seconds on a million rows
        out = out + " · " + df[c].astype(str)
    return out


def _thin(df: pd.DataFrame, y: str, cols: list[str], max_points: int) -> pd.DataFrame:
    """Downsample each line, then label it (labelling only the points kept)."""
    if not len(df):
        return df.assign(series=[])
    d = downsample(df, y, by=cols if len(cols) > 1 else cols[0], max_points=max_points)
    return d.assign(series=series_label(d, cols))


def reward_chart(reward: pd.DataFrame, marks: pd.DataFrame, x_col: str, x_title: str,
                 max_points: int = 2000) -> alt.LayerChart:
    """Online reward per family (per run); a dashed rule and the phase name at each drift event.
    Recovery is a table on the page (one row per event and family), not labels on the chart."""
    df = _thin(reward, "reward_w", ["run", "family"], max_points)
    lines = alt.Chart(df[[x_col, "reward_w", "series"]], name="reward_lines").mark_line(interpolate="linear").encode(
        x=_x(x_col, x_title), y=alt.Y("reward_w:Q", title="online reward (windowed)", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("series:N", title=None), tooltip=["series:N", f"{x_col}:Q", "reward_w:Q"])
    layers = [lines]
    if len(marks):
        m = marks.assign(text=marks["label"] if marks["run"].nunique() <= 1 else marks["run"] + ": " + marks["label"])
        base = alt.Chart(m[[x_col, "text"]])
        layers.append(base.mark_rule(strokeDash=[6, 4], color=DRIFT, size=1.5).encode(
            x=alt.X(f"{x_col}:Q"), tooltip=["text:N"]).properties(name="drift_rules"))
        layers.append(base.mark_text(align="left", baseline="top", dx=4, dy=2, fontSize=11, fontWeight="bold",
                                     color=DRIFT).encode(x=alt.X(f"{x_col}:Q"), y=alt.value(2), text="text:N")
                      .properties(name="drift_labels"))
    return alt.layer(*layers).properties(height=HEIGHT + 60, usermeta=SVG)


def lines_chart(df: pd.DataFrame, x_col: str, x_title: str, y_title: str, color_cols: list[str],
                max_points: int = 800, name: str = "lines", y_domain: tuple[float, float] | None = None) -> alt.Chart:
    """Lines per series; half-width charts get fewer points (the browser draws every one of them). `y_domain`:
    a fixed y range, values outside it drawn at its edge."""
    d = _thin(df, "value", color_cols, max_points)
    scale = alt.Scale(domain=list(y_domain), clamp=True) if y_domain else alt.Undefined
    return alt.Chart(d[[x_col, "value", "series"]], name=name).mark_line().encode(
        x=_x(x_col, x_title), y=alt.Y("value:Q", title=y_title, scale=scale),
        color=alt.Color("series:N", title=None, legend=alt.Legend(orient="bottom", columns=2, labelLimit=300)),
        tooltip=["series:N", f"{x_col}:Q", "value:Q"]).properties(height=HEIGHT, usermeta=CANVAS)


def staleness_chart(counts: pd.DataFrame) -> alt.Chart:
    d = counts.assign(series=series_label(counts, ["run"])) if len(counts) else counts.assign(series=[])
    legend = alt.Legend() if d["series"].nunique() > 1 else None
    return alt.Chart(d, name="staleness_bars").mark_bar().encode(
        x=alt.X("staleness:O", title="staleness (learner version − behaviour version)"),
        y=alt.Y("count:Q", title="trajectories"), color=alt.Color("series:N", title=None, legend=legend),
        xOffset="series:N", tooltip=["series:N", "staleness:O", "count:Q"]).properties(height=HEIGHT,
                                                                                   usermeta=CANVAS)

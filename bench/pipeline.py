"""The whole pipeline on its defaults: how much of the learner's own speed `sao up` keeps, and how much of what the
agents generate gets trained.

One invocation, in this order: (1) `sao up` on its defaults for a fixed time (`--max-seconds`, counted by the
launcher from the start of the roles, after the warm start), as a subprocess, with any extra arguments passed
through; (2) the isolated learner step, nothing else running, with the thread count the pipeline's learner used:
`bench/learner_step.py --lengths-from <run>/trajectories.parquet`, i.e. the learner's own step (same config, KL
reference included) on a batch of the run's own trajectory lengths; (3) the figures, from the run's artifacts:

- learner tokens/s inside the pipeline ÷ that isolated figure (goal >= 0.5): what the pipeline leaves of the
  learner's speed. Inside: Σ n_tokens × updates ÷ Σ perf/step_s over the learner's policy steps (critic-only
  warm-up steps left out: they skip the policy's forward and backward, so they are faster than the step measured
  alone; skipped steps left out), the run's first step and the first policy step left out too (allocator and
  first-call warm-ups, which learner_step.py also leaves out). `updates` is learner/updates_applied (1 on
  defaults), since the isolated figure is one update. Both count every token of the batch (prompt and response).
  For context, the same pipeline figure ÷ learner_step.py's fixed synthetic batch (64 rows of 32-80 tokens, a
  bare SAO step without KL): longer rows run faster per token, so that ratio is lower and is not the goal's.
- trained ÷ generated trajectories (goal >= 0.9): `streamer.runs.adaptation.trained_fraction` (the learner's
  n_trajectories over its applied steps ÷ rows of trajectories.parquet); as a check, the share of rows whose
  `learner_step` is filled (`streamer.runs.artifacts.trained_by`). A run stopped by time leaves the last, unfinished
  batch untrained: with a full batch of B trajectories, at most B / generated below what a drained run would show.
- learner steps per 1,000 trajectories generated (all steps, and policy steps only).
- learner busy share: `streamer.runs.adaptation.learner_busy_share` (1 − Σ idle ÷ the learner's wall time).

Writes <out>/pipeline.json and <out>/pipeline.png (the run itself stays in <runs-dir>/<run>/, `sao up`'s output in
<out>/up.log). The thread count of the pipeline's learner: the learner section of the run's config.yaml (what the
learner read), else config.json's resource plan, else the launcher's printed plan, else `--learner-threads`
(default 1).

    .venv/bin/python bench/pipeline.py                              # 600 s of sao up (+ warm start, ~1 min more)
    .venv/bin/python bench/pipeline.py --seconds 300 --learner-threads 2 -- --agents 1   # after --: to sao up
    .venv/bin/python bench/pipeline.py --quick                      # CI (<= 90 s): outputs produced, well-formed
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/pipeline.py`
    sys.path.insert(0, str(ROOT))

from bench import common as c  # noqa: E402
from streamer.runs import adaptation as ad  # noqa: E402
from streamer.runs import artifacts as art  # noqa: E402
from streamer.wire.config import ConfigError, read_yaml  # noqa: E402

GOAL_TOKENS_RATIO = 0.5
GOAL_TRAINED = 0.9


@dataclass
class Mode:
    seconds: float
    batch: int  # isolated step: sequences per batch (learner_step.py --batch)
    repeats: int  # isolated step: timed rounds (the minimum is taken)
    dashboard: bool = True
    up_args: list[str] = field(default_factory=list)  # always passed to sao up in this mode
    runs_dir: str = "runs"  # "": <out>/runs (a fresh warm-start cache)


MODES = {
    "full": Mode(600.0, 64, 5),
    # a 20-step warm start in its own cache, ~25 s of run: every output exists, the figures mean little
    "quick": Mode(25.0, 16, 2, dashboard=False, runs_dir="",
                  up_args=["--set", "pretrain.steps=20", "--set", "pretrain.eval_every=0"]),
}


# ------------------------------------------------------------------ the isolated step

def isolated_step(threads: int, batch: int, repeats: int, out: Path, lengths_from: Path) -> dict[str, Any]:
    """bench/learner_step.py in its own process (its own torch thread setting); its JSON, plus `wall_s`."""
    cmd = [sys.executable, str(ROOT / "bench" / "learner_step.py"), "--threads", str(threads), "--batch", str(batch),
           "--repeats", str(repeats), "--out", str(out), "--lengths-from", str(lengths_from)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"learner_step.py exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    res = json.loads(out.read_text())
    own = res["learner"]
    print(f"isolated learner step ({threads} thread{'s' * (threads != 1)}, {own['batch']} trajectories of the "
          f"run's lengths, {own['tokens']} tokens): {own['learner_tokens_per_s']:,.0f} tokens/s "
          f"({own['learner_s']:.3f} s a step); fixed synthetic batch ({res['tokens']} tokens): "
          f"{res['sao_tokens_per_s']:,.0f} tokens/s", flush=True)
    return {"threads": threads, "batch": batch, "repeats": repeats, "tokens": own["tokens"],
            "tokens_per_s": own["learner_tokens_per_s"], "step_s": own["learner_s"], "lengths_from": str(lengths_from),
            "fixed_batch": {"tokens": res["tokens"], "tokens_per_s": res["sao_tokens_per_s"], "step_s": res["sao_s"]},
            "load_avg_1m": res["load_avg_1m"], "wall_s": time.monotonic() - t0, "json": str(out),
            "measured": "after the run, nothing else running"}


# ------------------------------------------------------------------ the pipeline

def sao_command() -> list[str]:
    exe = Path(sys.executable).parent / "sao"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "streamer.launch.cli"]


def run_up(argv: list[str], log_path: Path, timeout_s: float) -> tuple[int, float]:
    """`sao up ARGV`, its output copied to `log_path` and ours; past `timeout_s` it gets SIGINT (the
    launcher's own clean stop: children stopped, tables compacted, summary written), then is killed."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        deadline, interrupted = t0 + timeout_s, False
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                print(f"  | {line}", end="", flush=True)
                if not interrupted and time.monotonic() > deadline:
                    print(f"sao up still running after {timeout_s:.0f} s: interrupting it", flush=True)
                    proc.send_signal(signal.SIGINT)
                    interrupted = True
        finally:
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    return rc, time.monotonic() - t0


_PLAN_LINE = re.compile(r"learner\b[^\n]*?(?:(\d+)\s*(?:torch\s+)?threads?\b|threads?\s*[=:]\s*(\d+))", re.I)


def _yaml_learner_threads(path: Path) -> int | None:
    """The learner section's threads in the run's config.yaml (what the learner read)."""
    try:
        threads = (read_yaml(path).get("learner") or {}).get("threads")
    except ConfigError:  # no config.yaml (a run from before it), or not YAML
        return None
    return threads if isinstance(threads, int) else None


def pipeline_threads(run_dir: Path, up_log: str) -> tuple[int | None, str]:
    """(torch threads of the pipeline's learner, where that came from) or (None, 'unknown')."""
    threads = _yaml_learner_threads(run_dir / "config.yaml")
    if threads is not None:
        return threads, "config.yaml: learner.threads"
    cfg = art.read_config(run_dir) or {}
    planned = (cfg.get("plan") or {}).get("learner_threads")
    if isinstance(planned, int):
        return planned, "config.json: plan.learner_threads"
    for line in up_log.splitlines():
        m = _PLAN_LINE.search(line)
        if m:
            return int(m.group(1) or m.group(2)), f"sao up output: {line.strip()[:120]}"
    return None, "unknown"


# ------------------------------------------------------------------ figures of the run

def policy_steps(learner: pd.DataFrame) -> pd.DataFrame:
    """Learner events that updated the policy (not critic-only warm-up, not skipped)."""
    if not len(learner):
        return learner
    keep = pd.Series(True, index=learner.index)
    if "learner/value_warmup" in learner:
        keep &= pd.to_numeric(learner["learner/value_warmup"], errors="coerce").fillna(0.0) != 1.0
    if "skipped" in learner:
        keep &= ~learner["skipped"].fillna(False).astype(bool)
    return learner[keep]


def pipeline_tokens_per_s(learner: pd.DataFrame) -> dict[str, Any]:
    """Learner tokens/s inside the pipeline: Σ n_tokens × updates ÷ Σ perf/step_s over policy steps, less the
    run's first step and the first policy step; `all_steps_tokens_per_s`: Σ n_tokens ÷ Σ perf/step_s over every
    step, for comparison."""
    out: dict[str, Any] = {"tokens_per_s": math.nan, "steps_counted": 0, "all_steps_tokens_per_s": math.nan}
    if not len(learner) or "perf/step_s" not in learner:
        return out
    step_s = pd.to_numeric(learner["perf/step_s"], errors="coerce")
    out["all_steps_tokens_per_s"] = float(learner["n_tokens"].sum() / step_s.sum()) if step_s.sum() > 0 else math.nan
    pol = policy_steps(learner)
    if len(pol):  # first-call warm-ups: the run's first step, and the first step through the policy's backward
        pol = pol[(pol["step"] != learner["step"].min()) & (pol["step"] != pol["step"].min())]
    if not len(pol):
        return out
    updates = (pd.to_numeric(pol["learner/updates_applied"], errors="coerce").fillna(1.0)
               if "learner/updates_applied" in pol else pd.Series(1.0, index=pol.index))
    secs = float(pd.to_numeric(pol["perf/step_s"], errors="coerce").sum())
    out.update(tokens_per_s=float((pol["n_tokens"] * updates).sum() / secs) if secs > 0 else math.nan,
               steps_counted=int(len(pol)), step_s_median=float(pd.to_numeric(pol["perf/step_s"]).median()),
               tokens_per_step_median=float(pol["n_tokens"].median()))
    return out


def trained_count(learner: pd.DataFrame) -> int:
    """Σ n_trajectories over applied steps (the numerator of `adaptation.trained_fraction`)."""
    if not len(learner) or "n_trajectories" not in learner:
        return 0
    applied = ~learner["skipped"].fillna(False).astype(bool) if "skipped" in learner else True
    return int(pd.to_numeric(learner["n_trajectories"], errors="coerce")[applied].sum())


def run_figures(run_dir: Path, isolated_tps: float, fixed_batch_tps: float) -> dict[str, Any]:
    traj, learner = art.read_trajectories(run_dir), art.read_learner(run_dir)
    generated = int(len(traj))
    tps = pipeline_tokens_per_s(learner)
    trained_rows = int(traj["learner_step"].notna().sum()) if generated and "learner_step" in traj else 0
    n_steps, n_policy = int(len(learner)), int(len(policy_steps(learner)))
    per_k = (lambda n: 1000.0 * n / generated) if generated else (lambda n: math.nan)
    figures = {
        "tokens_per_s_ratio": tps["tokens_per_s"] / isolated_tps if isolated_tps else math.nan,
        "tokens_per_s_ratio_fixed_batch": tps["tokens_per_s"] / fixed_batch_tps if fixed_batch_tps else math.nan,
        "trained_fraction": ad.trained_fraction(learner, generated),
        "learner_steps_per_1000_trajectories": per_k(n_steps),
        "policy_steps_per_1000_trajectories": per_k(n_policy),
        "learner_busy_share": ad.learner_busy_share(learner),
    }
    span = (float(traj["finished_at"].max() - traj["created_at"].min()) if generated else math.nan)
    pipeline = {"learner_tokens_per_s": tps["tokens_per_s"], **{k: v for k, v in tps.items() if k != "tokens_per_s"},
                "learner_steps": n_steps, "policy_steps": n_policy, "trajectories_generated": generated,
                "trajectories_trained": trained_count(learner),
                "trained_rows_fraction": trained_rows / generated if generated else math.nan,
                "trajectories_per_s": ad.rate(traj["finished_at"]) if generated else math.nan,
                "generation_span_s": span, "learner_counts": ad.learner_counts(learner)}
    return {"figures": figures, "pipeline": pipeline, "series": series(traj, learner)}


def series(traj: pd.DataFrame, learner: pd.DataFrame) -> dict[str, list]:
    """Per learner step (time since the first trajectory, tokens/s, policy step?) and cumulative
    generated / trained trajectories at each step's time, for the PNG."""
    if not len(learner) or not len(traj):
        return {"t": [], "tokens_per_s": [], "policy": [], "generated": [], "trained": []}
    lr = ad.sort_by(learner, "time")
    t0 = float(traj["created_at"].min())
    t = lr["time"].to_numpy(float)
    step_s = (pd.to_numeric(lr["perf/step_s"], errors="coerce").to_numpy(float) if "perf/step_s" in lr
              else np.full(len(lr), np.nan))
    pol = lr.index.isin(policy_steps(lr).index)
    applied = ~lr["skipped"].fillna(False).astype(bool).to_numpy() if "skipped" in lr else np.ones(len(lr), bool)
    trained = np.cumsum(np.where(applied, lr["n_trajectories"].to_numpy(float), 0.0))
    fin = np.sort(traj["finished_at"].to_numpy(float))
    return {"t": (t - t0).tolist(), "tokens_per_s": (lr["n_tokens"].to_numpy(float) / step_s).tolist(),
            "policy": pol.tolist(), "generated": np.searchsorted(fin, t, side="right").tolist(),
            "trained": trained.tolist()}


# ------------------------------------------------------------------ output

def goals(figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for key, goal in (("tokens_per_s_ratio", GOAL_TOKENS_RATIO), ("trained_fraction", GOAL_TRAINED)):
        v = figures[key]
        out[key] = {"goal": goal, "value": v, "met": bool(v is not None and not math.isnan(v) and v >= goal)}
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    plt = c.pyplot()
    fig, (a, b, d) = plt.subplots(1, 3, figsize=(15, 4.6))
    f, s = result["figures"], result["series"]
    names = ["tokens/s ratio", "trained fraction", "busy share"]
    vals = [f["tokens_per_s_ratio"], f["trained_fraction"], f["learner_busy_share"]]
    vals = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in vals]
    bars = a.bar(names, vals, color=["tab:blue", "tab:green", "tab:grey"])
    for bar, v in zip(bars, vals):
        a.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
    for x, g in ((0, GOAL_TOKENS_RATIO), (1, GOAL_TRAINED)):
        a.hlines(g, x - 0.4, x + 0.4, colors="red", linestyles="--", lw=1.2)
    a.set(ylim=(0, max(1.05, max(vals) * 1.1)), title="pipeline ÷ goals (red: goal)")
    iso = result["isolated"]["tokens_per_s"]
    t, tps, pol = np.asarray(s["t"], float), np.asarray(s["tokens_per_s"], float), np.asarray(s["policy"], bool)
    if t.size:
        b.plot(t[pol], tps[pol], "o", ms=3, label="policy step")
        b.plot(t[~pol], tps[~pol], "x", ms=4, color="tab:orange", label="critic-only / skipped")
    b.axhline(iso, color="black", ls="--", lw=1, label=f"isolated {iso:,.0f}")
    b.axhline(GOAL_TOKENS_RATIO * iso, color="red", ls=":", lw=1, label="goal (0.5 x isolated)")
    b.set(yscale="log", xlabel="s since the first task", ylabel="learner tokens/s", title="learner step speed")
    b.legend(fontsize=8)
    if t.size:
        d.plot(t, s["generated"], label="generated")
        d.plot(t, s["trained"], label="trained")
    d.set(xlabel="s since the first task", ylabel="trajectories", title="generated vs trained")
    d.legend(fontsize=8)
    m = result["machine"]
    return c.save_figure(fig, path, title=f"bench/pipeline ({result['mode']}): sao up for {result['seconds']:.0f} s "
                                          f"on {m['cpus']} CPUs, learner {result['isolated']['threads']} thread(s)")


def report(result: dict[str, Any]) -> None:
    f, p, g = result["figures"], result["pipeline"], result["goals"]
    iso = result["isolated"]

    def num(v, spec="{:.3g}"):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)

    print(f"learner tokens/s: {num(p['learner_tokens_per_s'], '{:,.0f}')} in the pipeline "
          f"({p['steps_counted']} policy steps counted) vs {num(iso['tokens_per_s'], '{:,.0f}')} isolated "
          f"({iso['threads']} thread(s), the run's lengths): ratio {num(f['tokens_per_s_ratio'])} (goal >= "
          f"{GOAL_TOKENS_RATIO}: {'met' if g['tokens_per_s_ratio']['met'] else 'NOT met'}); against the fixed "
          f"synthetic batch ({num(iso['fixed_batch']['tokens_per_s'], '{:,.0f}')} tokens/s): "
          f"{num(f['tokens_per_s_ratio_fixed_batch'])}")
    print(f"trained / generated: {num(f['trained_fraction'], '{:.4f}')} ({p['trajectories_trained']} of "
          f"{p['trajectories_generated']} trajectories) "
          f"(goal >= {GOAL_TRAINED}: {'met' if g['trained_fraction']['met'] else 'NOT met'}); rows with a "
          f"learner_step: {num(p['trained_rows_fraction'], '{:.4f}')}")
    print(f"learner steps per 1,000 trajectories: {num(f['learner_steps_per_1000_trajectories'])} "
          f"({num(f['policy_steps_per_1000_trajectories'])} policy steps); learner busy share "
          f"{num(f['learner_busy_share'])}; {p['learner_steps']} steps; stopped: {result['stopped']}")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI smoke: tiny warm start, ~25 s of run (<= 90 s in all)")
    p.add_argument("--seconds", type=float, help="sao up --max-seconds (default 600; quick 25)")
    p.add_argument("--run", default="bench-pipeline", help="run name (its directory is replaced)")
    p.add_argument("--runs-dir", help="sao up --runs-dir (default runs, with its warm-start cache; quick: <out>/runs)")
    p.add_argument("--out", default="runs/bench/pipeline")
    p.add_argument("--learner-threads", type=int, default=1,
                   help="threads of the isolated step when the run does not say what its learner used")
    p.add_argument("--no-dashboard", action="store_true", help="pass --no-dashboard to sao up")
    p.add_argument("--batch", type=int, help="isolated step: sequences per batch (default 64; quick 16)")
    p.add_argument("--timeout", type=float, help="interrupt sao up after this long (default: seconds + 1200)")
    args, unknown = p.parse_known_args(argv)
    return args, unknown + rest


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse(argv)
    name = "quick" if args.quick else "full"
    mode = MODES[name]
    seconds = args.seconds if args.seconds is not None else mode.seconds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs_dir or mode.runs_dir or out / "runs")
    run_dir = runs_dir / args.run
    if run_dir.exists():  # the launcher appends to a run directory: start clean
        shutil.rmtree(run_dir)
    machine = c.machine()
    batch = args.batch or mode.batch
    argv = [*sao_command(), "up", "--max-seconds", str(seconds), "--run", args.run, "--runs-dir", str(runs_dir)]
    if args.no_dashboard or not mode.dashboard:
        argv.append("--no-dashboard")
    argv += [*mode.up_args, *passthrough]
    print("running: " + " ".join(argv), flush=True)
    rc, wall = run_up(argv, out / "up.log", args.timeout or seconds + 1200)

    threads, source = pipeline_threads(run_dir, (out / "up.log").read_text())
    isolated = isolated_step(threads or args.learner_threads, batch, mode.repeats, out / "learner_step.json",
                             run_dir / "trajectories.parquet")
    summary = art.read_summary(run_dir) or {}
    result: dict[str, Any] = {
        "bench": "pipeline", "mode": name, "png": str(out / "pipeline.png"), "seconds": seconds,
        "command": argv, "rc": rc, "wall_s": wall, "stopped": summary.get("stopped"), "run_dir": str(run_dir),
        "machine": machine, "machine_after": c.machine(),
        "learner_threads": {"pipeline": threads, "source": source, "option": args.learner_threads},
        "isolated": isolated,
    }
    result.update(run_figures(run_dir, isolated["tokens_per_s"], isolated["fixed_batch"]["tokens_per_s"]))
    result["goals"] = goals(result["figures"])
    result["goals_met"] = all(g["met"] for g in result["goals"].values())
    result["definitions"] = {
        "tokens_per_s_ratio": "Σ n_tokens × learner/updates_applied ÷ Σ perf/step_s over policy steps (no "
                              "critic-only warm-up, no skipped step) less the run's first step and the first "
                              "policy step, ÷ the learner's own step isolated (learner_step.py --lengths-from the "
                              "run's trajectories.parquet, min over rounds) at the pipeline learner's thread count",
        "tokens_per_s_ratio_fixed_batch": "the same numerator ÷ learner_step.py's SAO step on its fixed synthetic "
                                          "batch (context, not the goal)",
        "trained_fraction": "streamer.runs.adaptation.trained_fraction: Σ n_trajectories of applied steps ÷ rows of "
                            "trajectories.parquet (a time-stopped run's last batch is not trained)",
        "learner_busy_share": "streamer.runs.adaptation.learner_busy_share: 1 − Σ perf/idle_s ÷ learner wall time",
        "learner_steps_per_1000_trajectories": "learner events (every step) × 1000 ÷ trajectories generated",
    }
    c.save_json(result, out / "pipeline.json")
    plot(result, out / "pipeline.png")
    report(result)
    print(f"saved {out / 'pipeline.json'} and {out / 'pipeline.png'}")
    return 0 if rc == 0 else rc


if __name__ == "__main__":
    raise SystemExit(main())

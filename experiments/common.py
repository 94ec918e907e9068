"""Shared pieces of the headline experiments (stability, lr_probe) and the suite.

Every run is the real pipeline: `streamer.launch.up.run(RunConfig)` (embedded broker, cached warm
start, metrics app, learner, agents, simulator as child processes, artifacts under <out>/runs/<run>/).
`launch` adds only a watcher thread that ends the run once a budget is met (generated tokens or
learner steps) through the launcher's stop API (`streamer.launch.up.Stop`); the figures come from the run's
artifacts through `streamer.runs.adaptation` (one definition of every metric: recovery, forgetting,
collapse, ...). This module is plumbing only: scenarios, launching, reading, statistics and plots. The machine,
JSON and figure helpers it shares with the benchmarks are bench.common's.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from experiments import stats
from learner.trainer.checkpoint import file_sha256
from streamer.runs import adaptation as ad

BASE_SCENARIO = "benchmark"
CACHE_DIR = "runs/bench/cache"  # warm starts shared by the three benchmarks (keyed by their config)


# ------------------------------------------------------------------ scenarios

def snapshot_base(name: str = BASE_SCENARIO) -> Path:
    """A content-addressed copy of the base scenario under CACHE_DIR. Every run of a benchmark (and
    the three benchmarks among themselves) warm-starts from this copy, so an edit of the scenario
    file while a table runs cannot give its runs different warm starts (the cache keys on the text
    and path of the scenario)."""
    import hashlib

    from simulator.scenario import resolve_path

    text = resolve_path(name).read_text()
    path = Path(CACHE_DIR) / f"{Path(name).stem}-{hashlib.sha256(text.encode()).hexdigest()[:10]}.yaml"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path


def base_scenario(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def scale_scenario(raw: dict[str, Any], scale: float, seed: int, **top: Any) -> dict[str, Any]:
    """The scenario with every phase length (and gradual width/center, recurring period) times
    `scale`, rounded, at least 1; `top` replaces top-level fields (e.g. latency=...)."""
    out = json.loads(json.dumps(raw))  # deep copy
    out.update(seed=seed, **top)
    for p in out["phases"]:
        for k in ("duration_tasks", "width", "center", "period"):
            if p.get(k):
                p[k] = max(1, round(p[k] * scale))
        if p.get("schedule") == "recurring" and p["period"] >= p["duration_tasks"]:
            p["period"] = max(1, p["duration_tasks"] // 2)
    return out


def write_scenario(raw: dict[str, Any], path: Path) -> Path:
    import yaml

    from simulator.scenario import load_scenario

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    load_scenario(path)  # a bad scaling fails here, naming the phase and field
    return path


# ------------------------------------------------------------------ runs

@dataclass
class Algo:
    """One benchmark configuration: launcher options and learner overrides (`sao up --set`)."""

    name: str
    loss: str = "sao"
    group_size: int = 1
    sets: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class Budget:
    gen_tokens: int = 0  # stop once the run's trajectories hold this many generated tokens (0: no)
    learner_steps: int = 0  # stop once the learner logged this many steps (0: no)
    max_seconds: float = 600.0  # safety cap on the whole run


def launch(algo: Algo, run: str, scenario: Path, runs_dir: Path, budget: Budget, pretrain: list[str],
           base: Path, seed: int = 0, agents: int = 2, sync: bool = False, sync_batch: int = 64,
           extra_sets: list[str] = (), realtime: bool = False, evaluate: bool = False,
           agent_sets: list[str] = ()) -> dict[str, Any]:
    """Run the pipeline once on `scenario`, warm-started from the `base` snapshot (`snapshot_base`);
    `evaluate`: also run the held-out evaluator role (eval/reward per concept: forgetting), which
    costs CPU; returns {run_dir, stopped, wall_s, rc}."""
    from streamer.launch.run_config import is_derived, load_run_config, pin_derived
    from streamer.launch.up import Stop
    from streamer.launch.up import run as up

    sets = [f"pretrain.scenario={base}", f"pretrain.cache_dir={CACHE_DIR}", *(f"pretrain.{s}" for s in pretrain),
            f"learner.seed={seed}", *(f"learner.{s}" for s in (*algo.sets, *extra_sets)),
            *(f"agent.{s}" for s in agent_sets)]
    launch = dict(scenario=str(scenario), run=run, runs_dir=str(runs_dir), agents=agents, group_size=algo.group_size,
                  loss=algo.loss, sync=sync, sync_batch=sync_batch, dashboard=False, max_seconds=budget.max_seconds,
                  realtime=realtime, eval=evaluate)
    cfg = load_run_config(None, [s for s in sets if not is_derived(s.partition("=")[0])], launch)
    cfg = pin_derived(cfg, [s for s in sets if is_derived(s.partition("=")[0])])
    run_dir = runs_dir / run
    if run_dir.exists():  # the launcher appends to a run directory: start clean
        import shutil
        shutil.rmtree(run_dir)
    stop = Stop()
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(stop, run_dir, budget, done), daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        rc = up(cfg, stop)
    finally:
        done.set()
        watcher.join(timeout=5)
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the launcher leaves SIGINT ignored
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = stop.reason if stop.requested else str(summary.get("stopped", ""))
    return {"run_dir": str(run_dir), "stopped": stopped, "wall_s": time.monotonic() - t0, "rc": rc}


def _watch(stop, run_dir: Path, budget: Budget, done: threading.Event) -> None:
    """Asks the launcher to stop (`streamer.launch.up.Stop`) once a budget is met."""
    from streamer.runs.artifacts import read_learner, read_trajectories

    while not done.wait(2.0):
        try:
            if budget.gen_tokens:
                traj = read_trajectories(run_dir)
                tokens = int(traj["n_gen_tokens"].sum()) if len(traj) else 0
                if tokens >= budget.gen_tokens:
                    stop.request(f"token budget {budget.gen_tokens} reached ({tokens})")
            if budget.learner_steps and not stop.requested:
                steps = len(read_learner(run_dir))
                if steps >= budget.learner_steps:
                    stop.request(f"{budget.learner_steps} learner steps reached ({steps})")
        except Exception:  # a part being written: try again at the next tick
            continue
        if stop.requested:
            return


def read_run(run_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, list[dict]]:
    """(trajectories in finish order, learner events, drift events as dicts)."""
    import msgspec

    from streamer.runs.artifacts import read_drift, read_learner, read_trajectories

    traj = read_trajectories(run_dir)
    if len(traj):
        traj = ad.sort_by(traj, "finished_at").reset_index(drop=True)
    return traj, read_learner(run_dir), [msgspec.to_builtins(e) for e in read_drift(run_dir)]


# ------------------------------------------------------------------ curves

def curve(traj: pd.DataFrame, grid: np.ndarray, window: int) -> np.ndarray:
    """Windowed online reward (all families) at each trajectory count of `grid` (NaN past the end)."""
    w = ad.windowed_reward(traj["reward"].to_numpy(float), window) if len(traj) else np.zeros(0)
    idx = np.asarray(grid, int) - 1
    out = np.full(idx.size, np.nan)
    ok = (idx >= 0) & (idx < w.size)
    out[ok] = w[idx[ok]]
    return out


# ------------------------------------------------------------------ statistics and output

def mean_ci(values) -> dict[str, float]:
    """Mean and 95% Student-t interval over seeds (NaNs dropped; lo = hi = mean for one value)."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], float)
    if v.size == 0:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    m = float(v.mean())
    if v.size == 1:
        return {"mean": m, "lo": m, "hi": m, "n": 1}
    t = stats.t_interval(v)
    return {"mean": t["mean"], "lo": t["low"], "hi": t["high"], "n": t["n"]}


def json_equal(a: Any, b: Any) -> bool:
    """Equal as JSON, key order aside: what two result files mean by the same value."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def differing(a: dict, b: dict, keys: tuple[str, ...]) -> list[str]:
    """The `keys` whose values differ between two result files (`json_equal`; a missing key reads as None)."""
    return [k for k in keys if not json_equal(a.get(k), b.get(k))]


@functools.lru_cache(maxsize=None)
def init_sha256(init: str) -> str:
    """The warm start's weights digest. `build_init` caches a warm start by its config, but two builds of one config
    differ in their bits (the pretraining's thread count follows the machine's load), so a run records the weights it
    started from, and runs from different weights are neither reused nor combined."""
    return file_sha256(Path(init) / "model.safetensors")


def reusable_run(path: Path, want: dict[str, Any], fill: Callable[[dict], dict] = lambda run: run) -> dict | None:
    """The run file at `path` when every setting in `want` equals what the file recorded (an interrupted or extended
    benchmark resumes run by run), else None. `fill` completes what an older file lacks before the comparison
    (e.g. a field added since, with the default it ran with)."""
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    have = fill(run)
    return run if all(have.get(k) == v for k, v in want.items()) else None


def fmt(v: Any, spec: str = "{:.3g}") -> str:
    """A Markdown table cell: `v` formatted with `spec`, '-' when it is missing."""
    return "-" if v is None else spec.format(v)


def band(curves: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pointwise mean and 95% interval over seeds of equally long curves."""
    per_point = [mean_ci(col) for col in np.asarray(curves, float).T]
    return tuple(np.array([s[k] for s in per_point], float) for k in ("mean", "lo", "hi"))  # type: ignore


def asdicts(items) -> list[dict]:
    return [asdict(i) for i in items]


Progress = Callable[[str], None]

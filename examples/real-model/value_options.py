"""examples/real-model, the critic's options compared on recovery and memory; writes value_options.json.

    .venv/bin/python examples/real-model/value_options.py                      # seeds 1,2; copy and copy-8
    .venv/bin/python examples/real-model/value_options.py --skip-runs          # the figures again from the runs

The example trains a value head on the LoRA policy's backbone (`value.kind=head`, run.yaml). Beside it, the same
`sao up` (measure.py's command) with the critic as a separate model:

    copy      value.kind=copy: a full copy of the 30-layer backbone with its own head (today's default)
    copy-8    value.kind=copy, value.layers=8: the first 8 blocks of the backbone, a smaller critic

Both copies train every weight of the critic, so they take the profile's value_lr for full weights (1e-5, verl's
critic default), not the head's 1e-3. The head's figures are measure.py's runs of the same seeds (measured.json's
run directories, analysed again). Per run: the reward and success margins (first and last 48 answers), the drift's
recovery (summary.json), learner steps, and the learner process's peak resident memory (VmHWM, polled from /proc
while the run lasts).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

import measure  # noqa: E402

from bench.common import git_commit, machine, save_json  # noqa: E402

OPTIONS = {
    "head": (),
    "copy": ("learner.value.kind=copy", "learner.optim.value_lr=1e-5"),
    "copy-8": ("learner.value.kind=copy", "learner.value.layers=8", "learner.optim.value_lr=1e-5"),
}
RUN_NAMES = {"head": "real-model"}  # measure.py's own runs; the others are real-model-<option>-s<seed>


def learner_peak_gib(stop: threading.Event, out: dict) -> None:
    """The largest VmHWM of a `sao learn` process seen until `stop` (polled every 5 s)."""
    while not stop.wait(5.0):
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if b"streamer.launch.cli" not in argv or b"learn" not in argv:
                    continue
                for line in (proc / "status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        gib = int(line.split()[1]) / 2**20
                        out["learner_peak_rss_gib"] = round(max(out.get("learner_peak_rss_gib", 0.0), gib), 2)
            except OSError:
                continue


def run_option(model_dir: Path, runs_dir: Path, option: str, seed: int, max_seconds: float) -> dict:
    stop, peak = threading.Event(), {}
    watcher = threading.Thread(target=learner_peak_gib, args=(stop, peak), daemon=True)
    watcher.start()
    try:
        launch = measure.run_seed(model_dir, seed, runs_dir, max_seconds, f"real-model-{option}", OPTIONS[option])
    finally:
        stop.set()
        watcher.join()
    return {**launch, **peak}


def summarize(run: dict) -> dict:
    """The figures compared across options, from measure.analyze's."""
    keep = {"trajectories": run["trajectories"], "overall": run["overall"], "concepts": run["concepts"],
            "learner": run.get("learner"), "recoveries": run["recoveries"]}
    return {**keep, "launch": run["launch"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default="runs/models/smollm2")
    p.add_argument("--runs-dir", default="runs/real-model")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--options", default="copy,copy-8", help="options to run (head: measure.py's runs, never rerun)")
    p.add_argument("--max-seconds", type=float, default=600.0)
    p.add_argument("--window", type=int, default=48)
    p.add_argument("--skip-runs", action="store_true", help="analyse the runs already in --runs-dir")
    p.add_argument("--keep", default="", help="options whose runs in --out are analysed again, not rerun")
    p.add_argument("--out", default=str(HERE / "value_options.json"))
    a = p.parse_args(argv)
    runs_dir, out_path = measure.ROOT / a.runs_dir, Path(a.out)
    old = json.loads(out_path.read_text()) if out_path.is_file() else {}
    head_launch = json.loads((HERE / "measured.json").read_text())["runs"]
    result = {"command": "python examples/real-model/value_options.py",
              "options": {k: list(v) for k, v in OPTIONS.items()},
              "commit": git_commit(), "machine": machine(), "max_seconds": a.max_seconds,
              "runs": old.get("runs", {})}  # runs not named this time are kept (a seed rerun alone)
    for option in ["head", *a.options.split(",")]:
        for seed in (int(s) for s in a.seeds.split(",")):
            name = f"{RUN_NAMES.get(option, 'real-model-' + option)}-s{seed}"
            if option == "head" and name not in head_launch:
                print(f"head seed {seed}: not among measure.py's runs, skipped", flush=True)
                continue
            if option == "head":
                launch = head_launch[name]["launch"]
            elif a.skip_runs or (option in a.keep.split(",") and str(seed) in old.get("runs", {}).get(option, {})):
                launch = old["runs"][option][str(seed)]["launch"]
            else:
                print(f"{option} seed {seed} ...", flush=True)
                launch = run_option(Path(a.model_dir), runs_dir, option, seed, a.max_seconds)
            run = {"launch": launch, **measure.analyze(runs_dir / name, a.window)}
            earlier = old.get("runs", {}).get(option, {}).get(str(seed))
            row = summarize(run)
            if earlier and earlier["launch"] != launch:  # run again: the attempt it replaces stays on record
                row["previous_attempt"] = {k: earlier[k] for k in ("launch", "trajectories", "overall", "learner")}
            elif earlier and "previous_attempt" in earlier:
                row["previous_attempt"] = earlier["previous_attempt"]
            result["runs"].setdefault(option, {})[str(seed)] = row
            print(option, seed, json.dumps(run["overall"]), launch.get("learner_peak_rss_gib"), flush=True)
    result["over_seeds"] = {o: measure.over_seeds(r) for o, r in result["runs"].items()}
    save_json(result, out_path)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

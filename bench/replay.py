"""Replay throughput: a 1,000,000-task recorded stream replayed at --speed 100 must keep up.

Generates the file (JSONL by default) from a long scenario, replays it with `sao replay` in a
child process (so the peak memory measured is the replayer's alone), and prints and saves tasks/s,
the worst lag behind the scaled schedule and the peak RSS to runs/bench/replay.json.

    python bench/replay.py [--tasks 1000000] [--rate 100] [--speed 100] [--format jsonl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from simulator.run import simulate
from simulator.scenario import Phase, Scenario, validate_scenario
from simulator.sinks import file_sink


def long_scenario(n: int, rate: float) -> Scenario:
    mix = {"arith": 1.0, "string": 1.0, "format": 1.0, "tool": 1.0}
    first = Phase(name="a", duration_tasks=n // 2, families=mix,
                  concepts={"arith": "add10", "string": "reverse", "format": "brackets", "tool": "look/plain/0"})
    second = Phase(name="b", duration_tasks=n - n // 2, concepts={"string": "sort", "tool": "find/plain/0"})
    scn = Scenario(name="bench", rate=rate, arrival="poisson", phases=[first, second])
    validate_scenario(scn)
    return scn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, default=100.0, help="tasks per second of the recorded stream")
    p.add_argument("--speed", type=float, default=100.0)
    p.add_argument("--format", default="jsonl", choices=["jsonl", "parquet", "csv"])
    p.add_argument("--workdir", default="runs/bench/replay-tmp")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    args = p.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / f"stream.{args.format}", work / "replayed.jsonl"
    t = time.perf_counter()
    simulate(long_scenario(args.tasks, args.rate), file_sink(src), seed=0, t0=1_000_000.0)
    gen_s = time.perf_counter() - t
    cmd = [sys.executable, "-m", "streamer.launch.cli", "replay", str(src), "--speed", str(args.speed),
           "--out", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    target_s = (args.tasks / args.rate) / args.speed  # the schedule's length at this speed
    result = {
        "tasks": stats["tasks"], "format": args.format, "rate": args.rate, "speed": args.speed,
        "file_mb": round(src.stat().st_size / 2**20, 1), "generate_s": round(gen_s, 1),
        "replay_s": round(stats["seconds"], 2), "schedule_s": round(target_s, 2),
        "tasks_per_s": round(stats["tasks_per_s"]), "required_tasks_per_s": round(args.rate * args.speed),
        "max_lag_s": round(stats["max_lag_s"], 3), "peak_rss_mb": round(stats["peak_rss_mb"], 1),
        "process_wall_s": round(wall, 1),
        "keeps_up": stats["seconds"] <= target_s * 1.02 + 1.0,
    }
    print(json.dumps(result, indent=1))
    Path("runs/bench").mkdir(parents=True, exist_ok=True)
    Path("runs/bench/replay.json").write_text(json.dumps(result, indent=1))
    if not args.keep:
        src.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Chaos: faults injected for real into `sao up` (2 agents), then every task and every bad record accounted for.

Per seed, two runs:

1. **Main run**: an embedded broker of the bench's own (so the topics outlive the run and can be read back), then
   `sao up --bootstrap <it> --agents 2 --seed <seed> --restarts 100 --limit N` while a plan of faults runs
   (`bench.chaos_faults`): SIGKILL of the learner, each agent and the metrics app (the launcher restarts each);
   SIGSTOP of an agent and of the learner for longer than the consumers' session timeout
   (`ClientSettings.session_timeout_ms`), then SIGCONT; bad records on every consumed topic (tasks, trajectories,
   policy, learner: bytes that do not decode, a record of the wrong shape, and one that decodes but lies, e.g. a
   forged unsigned policy announcement of version 10^15). The roles are found as `sao up`'s child processes.
2. **Broker run**: `sao up` with its own embedded broker, which is SIGKILLed once the learner has trained; the
   time until `sao up` stops (and whether its reason names the broker), and what the memory-only broker took
   with it.

Accounting (`bench.chaos_accounting`): lost, trained twice, dead letters per (consumer, record), time to detect and
to recover, per fault class. Goals: every requested fault injected, 0 lost, 0 trained twice, every bad record
dead-lettered and by no consumer twice, no bad record trained. Exits 1 when a goal is missed (2 when a requested
fault was not injected). The JSON is written by this script only.

    .venv/bin/python bench/chaos.py                       # 3 seeds -> docs/results/chaos.json
    .venv/bin/python bench/chaos.py --quick               # 1 seed, 4 faults -> runs/bench/chaos/chaos.json
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/chaos.py`
    sys.path.insert(0, str(ROOT))

from bench.chaos_accounting import account, learner_idle_before, timings  # noqa: E402
from bench.chaos_faults import Fault, Injector, send_bad_records  # noqa: E402
from bench.chaos_report import broker_result, goals, summarize  # noqa: E402
from bench.common import git_commit, machine, save_json  # noqa: E402
from streamer.transport.broker import EmbeddedBroker  # noqa: E402
from streamer.wire.settings import BrokerSettings, ClientSettings  # noqa: E402
from streamer.wire.topics import partitions_by_topic  # noqa: E402

PAUSE_S = 2.5 * ClientSettings().session_timeout_ms / 1000  # a pause the group must notice (15 s at 6 s)
FULL_PLAN = [(6, "bad_records", ""), (15, "sigkill", "learner"), (28, "sigkill", "agent-0"),
             (40, "sigstop", "agent-1"), (62, "sigkill", "metrics"), (75, "sigkill", "agent-1"),
             (88, "sigstop", "learner"), (110, "sigkill", "learner"), (120, "sigkill", "agent-0")]
QUICK_PLAN = [(5, "bad_records", ""), (12, "sigkill", "learner"), (22, "sigkill", "agent-0"),
              (30, "sigstop", "agent-1"), (55, "sigkill", "metrics")]
QUICK_WARM_START = ["--set", "pretrain.steps=120", "--set", "pretrain.eval_every=0"]  # a cold cache costs ~30 s
UP_FLAGS = ["--agents", "2", "--no-dashboard", "--no-eval", "--restarts", "100", "--cores", "2"]


def plan(rows: list[tuple[float, str, str]], seed: int) -> list[Fault]:
    """The plan's faults, each moved by up to +-15% (seeded), pauses of PAUSE_S."""
    rng = random.Random(seed)
    return [Fault(at_s=round(t * rng.uniform(0.85, 1.15), 1), kind=kind, role=role,
                  pause_s=PAUSE_S if kind == "sigstop" else 0.0) for t, kind, role in rows]


def follow(proc: subprocess.Popen, log_path: Path, on_line=None) -> list[tuple[float, str]]:
    """`sao up`'s output lines with the wall time each was read, echoed and logged; `on_line(line)` sees each."""
    lines: list[tuple[float, str]] = []
    with open(log_path, "w") as log:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append((time.time(), line.rstrip("\n")))
            log.write(line)
            print(f"  | {line}", end="", flush=True)
            if on_line is not None:
                on_line(line)
    return lines


def up_command(run: str, runs_dir: Path, seed: int, tasks: int, drain_s: float, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "streamer.launch.cli", "up", "--run", run, "--runs-dir", str(runs_dir),
            "--seed", str(seed), "--limit", str(tasks), "--drain-seconds", str(drain_s), *UP_FLAGS, *extra]


def fresh(run_dir: Path) -> None:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


def main_run(a: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """One seed's run under the fault plan, on a broker of the bench's own; its accounting."""
    run, runs_dir = f"chaos-s{seed}", Path(a.runs_dir)
    fresh(runs_dir / run)
    broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(out / f"broker-s{seed}.log"))).start()
    try:
        from streamer.transport.kafka_bus import KafkaBus

        KafkaBus(broker.bootstrap).create_topics(partitions_by_topic(run, agents=2))
        cmd = up_command(run, runs_dir, seed, a.tasks, a.drain, ["--bootstrap", broker.bootstrap, *a.up_args,
                                                                 "--max-seconds", str(a.max_seconds)])
        print("running: " + shlex.join(cmd), flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        faults = plan(QUICK_PLAN if a.quick else FULL_PLAN, seed)
        injector = Injector(proc.pid, faults, lambda: send_bad_records(broker.bootstrap, run))

        def on_line(line: str) -> None:
            if line.startswith("[4/4]"):
                injector.start()

        lines = follow(proc, out / f"up-s{seed}.log", on_line)
        rc = proc.wait()
        injector.stop.set()
        if injector.thread.is_alive():
            injector.thread.join(timeout=PAUSE_S + 5)
        log = injector.log()
        bad = [r for f in log for r in f["done"].get("records", [])]
        result = {"seed": seed, "run": run, "command": cmd, "rc": rc, "stopped": stopped(lines),
                  "wall_s": round(lines[-1][0] - lines[0][0], 1) if lines else 0.0,
                  **account(broker.bootstrap, run, runs_dir / run, bad)}
    finally:
        broker.stop()
    result["faults"] = timings(runs_dir / run, lines, log)
    stop_wall = next((w for w, line in lines if line.startswith("stopping: ")), lines[-1][0] if lines else time.time())
    result["learner_idle_before_stop_s"] = learner_idle_before(runs_dir / run, stop_wall)
    return result


def stopped(lines: list[tuple[float, str]]) -> str:
    return next((line[len("stopping: "):] for _, line in reversed(lines) if line.startswith("stopping: ")), "")


def broker_run(a: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """`sao up` on its own embedded broker; the broker SIGKILLed once the learner has trained a step."""
    run, runs_dir = f"chaos-broker-s{seed}", Path(a.runs_dir)
    fresh(runs_dir / run)
    cmd = up_command(run, runs_dir, seed, a.broker_tasks, a.drain, [*a.up_args, "--max-seconds", "90"])
    print("running: " + shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fault = Fault(at_s=0.0, kind="sigkill", role="broker")
    injector = Injector(proc.pid, [fault], lambda: [])
    progress: dict[str, str] = {}

    def on_line(line: str) -> None:  # the kill once the learner has trained (`learner step N`, N >= 1)
        if " learner step " in line and "learner step -" not in line and not injector.thread.is_alive() \
                and not fault.done:
            progress["at_kill"] = line.strip()
            injector.start()

    lines = follow(proc, out / f"up-broker-s{seed}.log", on_line)
    rc, exit_wall = proc.wait(), time.time()
    injector.stop.set()
    if injector.thread.is_alive():  # the fault's record is written when inject() returns
        injector.thread.join(timeout=10)
    reason = stopped(lines)
    return {"seed": seed, "run": run, "command": cmd, "rc": rc, "stopped": reason,
            "progress_at_kill": progress.get("at_kill", ""),
            **broker_result(runs_dir / run, timings(runs_dir / run, lines, injector.log())[0], lines, reason,
                            exit_wall)}


def command_line(argv: list[str] | None) -> str:
    """The command that produced the result, as typed from the checkout's root."""
    python = Path(sys.executable)
    python_shown = str(python.relative_to(ROOT)) if python.is_relative_to(ROOT) else str(python)
    return shlex.join([python_shown, "bench/chaos.py", *(sys.argv[1:] if argv is None else argv)])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 4 faults, 2,400 tasks (a few minutes on 2 cores)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tasks", type=int, default=4000, help="sao up --limit of each main run")
    p.add_argument("--broker-tasks", type=int, default=1200, help="sao up --limit of each broker run")
    p.add_argument("--drain", type=float, default=60.0, help="sao up --drain-seconds")
    p.add_argument("--max-seconds", type=float, default=330.0, help="sao up --max-seconds of each main run")
    p.add_argument("--no-broker-run", dest="broker_run", action="store_false")
    p.add_argument("--up-args", default="", help="more `sao up` arguments, one shell-quoted string")
    p.add_argument("--out", default=None, help="the JSON (default: docs/results/chaos.json; --quick: "
                                               "runs/bench/chaos/chaos.json)")
    p.add_argument("--runs-dir", default="runs/chaos", help="sao up --runs-dir")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.tasks, a.broker_tasks, a.drain, a.max_seconds = a.seeds[:1], 2400, 600, 30.0, 300.0
    a.up_args = shlex.split(a.up_args) + (QUICK_WARM_START if a.quick else [])
    a.out = Path(a.out or ("runs/bench/chaos/chaos.json" if a.quick else "docs/results/chaos.json"))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = ROOT / "runs" / "bench" / "chaos"
    out.mkdir(parents=True, exist_ok=True)
    t0, runs, broker_runs = time.monotonic(), [], []
    for seed in a.seeds:
        runs.append(main_run(a, seed, out))
        if a.broker_run:
            broker_runs.append(broker_run(a, seed, out))
    result = {"bench": "chaos", "mode": "quick" if a.quick else "full",
              "command": command_line(argv),
              "commit": git_commit(), "machine": machine(), "seeds": a.seeds, "pause_s": PAUSE_S,
              "session_timeout_s": ClientSettings().session_timeout_ms / 1000, "wall_s": time.monotonic() - t0,
              "runs": runs, "broker_runs": broker_runs}
    result["by_fault_class"] = summarize(runs, broker_runs)
    result["goals"] = goals(runs, broker_runs)
    result["goals_met"] = all(result["goals"].values())
    save_json(result, a.out)
    print(json.dumps({"by_fault_class": result["by_fault_class"], "goals": result["goals"]}, default=str, indent=1))
    print(f"saved {a.out}")
    if not result["goals"]["every_fault_injected"]:
        print("chaos: a requested fault was not injected (see runs[].faults[].done.missed)", file=sys.stderr)
        return 2
    return 0 if result["goals_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

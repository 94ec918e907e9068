"""Chaos: SIGKILL the learner, an agent and the metrics app at random moments of `sao up`, then account for every task.

One invocation: (1) an embedded broker of its own (so the run's topics outlive the run); (2) a few malformed
messages on the task topic, which must end in the DLQ; (3) `sao up --bootstrap <it> --restarts 100 --limit N`
(weights published, checkpoints every 10 learner steps, the dashboard off, 120 s for the learner to train its
backlog after the last trajectory) while a killer thread sends SIGKILL to
a random one of the learner, agent-0 and the metrics app every `--every` seconds (uniform 0.5x-1.5x) until
`--kills` kills (the launcher restarts each); (4) the accounting, from the broker and the run directory:

- every task the simulator published (read back from `<run>.tasks`, plus any the agents answered) is trained
  exactly once (the learner's standing events:
  `streamer.runs.artifacts.read_learner`), or buffered in the learner's last checkpoint (`pending.jsonl`: a run that
  stops mid-batch), or dead-lettered (`<run>.dlq`, with its reason);
- every malformed record is dead-lettered exactly once;
- the learner's stale drops (`learner/count_stale`), which pacing keeps at 0 without restarts: any here would be
  restart-caused.

Goal: 0 lost, 0 trained twice, 0 stale drops, 0 letters sent twice. Writes <out>/chaos.json.

    .venv/bin/python bench/chaos.py                       # 12 kills over ~6,000 tasks (~6 min on 2 cores)
    .venv/bin/python bench/chaos.py --quick               # 3 kills over 1,500 tasks
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # `python bench/chaos.py`
    sys.path.insert(0, str(ROOT))

from bench.common import machine, save_json  # noqa: E402
from streamer.runs import artifacts as art  # noqa: E402
from streamer.transport.broker import EmbeddedBroker  # noqa: E402
from streamer.transport.kafka_bus import KafkaBus, read_topic  # noqa: E402
from streamer.wire.schema import (  # noqa: E402
    DeadLetter,  # noqa: E402
    SchemaError,
    Task,
    Trajectory,
    decode,
    decode_json,
)
from streamer.wire.settings import BrokerSettings, ClientSettings  # noqa: E402
from streamer.wire.topics import Topics, partitions_by_topic  # noqa: E402

TARGETS = {"learner": "learn", "agent-0": "agent", "metrics": "metrics"}  # role -> its `sao` command
MALFORMED = [b"\x00not msgpack", b"\x82\xa1v\x63\xa7task_id\xa1x", b"{}"]


def role_pids(run: str) -> dict[str, int]:
    """PIDs of the run's roles, from /proc: `python -m streamer.launch.cli <command> ... --run <run>`."""
    out: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "streamer.launch.cli" not in args or run not in args:
            continue
        command = args[args.index("streamer.launch.cli") + 1]
        for role, cmd in TARGETS.items():
            if command == cmd:
                out[role] = int(d.name)
    return out


def killer(run: str, kills: int, every_s: float, stop: threading.Event, log: list[dict[str, Any]], t0: float) -> None:
    rng = random.Random(0)
    time.sleep(every_s)
    while len(log) < kills and not stop.is_set():
        pids = role_pids(run)
        if pids:
            role = rng.choice(sorted(pids))
            try:
                os.kill(pids[role], signal.SIGKILL)
                log.append({"t": round(time.monotonic() - t0, 1), "role": role, "pid": pids[role]})
                print(f"chaos: SIGKILL {role} (pid {pids[role]}) at {log[-1]['t']} s, kill {len(log)} of {kills}",
                      flush=True)
            except ProcessLookupError:
                pass
        stop.wait(every_s * rng.uniform(0.5, 1.5))


def whole_topic(bootstrap: str, topic: str) -> list[tuple[int, int, bytes]]:
    """Every record of `topic`: to its end offsets, then until 3 s (12 polls) brought nothing."""
    return read_topic(bootstrap, ClientSettings(), topic, timeout_s=120.0, idle_polls=12)


def account_run(run_dir: Path, task_ids: set[str], dead_tasks: set[str]) -> dict[str, Any]:
    """Every task (those read from the topic, and those the agents answered) trained once, buffered in the last
    checkpoint, or dead-lettered; the learner's drop counts."""
    tasks = task_ids | set(art.read_trajectories(run_dir)["task_id"].astype(str))
    learner = art.read_learner(run_dir)
    trained = Counter(t for ids in learner["task_ids"] for t in (json.loads(ids) if isinstance(ids, str) else ids)
                      ) if len(learner) else Counter()
    ckpt = max((run_dir / "checkpoints").glob("step_*"), default=None)
    pending = ({decode_json(line, Trajectory).task_id for line in (ckpt / "pending.jsonl").read_bytes().splitlines()
                if line} if ckpt is not None else set())
    last = learner.iloc[-1].dropna().to_dict() if len(learner) else {}
    return {
        "tasks": len(tasks), "trained_once": sum(1 for t in tasks if trained[t] == 1),
        "trained_twice": sorted(t for t in tasks if trained[t] > 1),
        "buffered_in_last_checkpoint": len(pending & tasks), "dead_lettered_tasks": len(dead_tasks & tasks),
        "lost": sorted(t for t in tasks if trained[t] == 0 and t not in pending and t not in dead_tasks),
        "stale_drops": float(last.get("learner/count_stale", 0.0)),
        "duplicate_drops": float(last.get("learner/count_duplicate", 0.0)), "learner_steps": int(len(learner)),
    }


def account(bootstrap: str, run: str, run_dir: Path, malformed: int) -> dict[str, Any]:
    topics = Topics(run)
    tasks, bad_records, records = set(), set(), whole_topic(bootstrap, topics.tasks)
    for part, off, value in records:
        try:
            tasks.add(decode(value, Task).task_id)
        except SchemaError:
            bad_records.add((part, off))
    letters = [decode(v, DeadLetter) for _, _, v in whole_topic(bootstrap, topics.dlq)]
    letter_keys = Counter((x.consumer, x.topic, x.partition, x.offset) for x in letters)  # once per consumer
    dead_tasks = {x.key.decode() for x in letters if x.key and x.expected == "Task"}
    bad_dead = {(p, o) for (_, topic, p, o) in letter_keys if topic == topics.tasks} & bad_records
    return {"task_records": len(records), "tasks_in_topic": len(tasks), "malformed_published": len(bad_records),
            "malformed_sent": malformed, "malformed_dead_lettered": len(bad_dead),
            "letters_sent_twice": sum(1 for n in letter_keys.values() if n > 1),
            "dlq_reasons": sorted({x.reason[:120] for x in letters}), **account_run(run_dir, tasks, dead_tasks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 kills over 1,500 tasks")
    p.add_argument("--tasks", type=int, default=6000, help="sao up --limit")
    p.add_argument("--kills", type=int, default=12)
    p.add_argument("--every", type=float, default=14.0, help="mean seconds between kills")
    p.add_argument("--out", default="runs/bench/chaos")
    p.add_argument("--runs-dir", default="runs", help="sao up --runs-dir (the run goes to <runs-dir>/chaos)")
    a = p.parse_args(argv)
    if a.quick:
        a.tasks, a.kills, a.every = 1500, 3, 10.0
    out, run = Path(a.out), "chaos"
    runs_dir = Path(a.runs_dir)  # its cache holds the warm start
    if (runs_dir / run).exists():
        import shutil

        shutil.rmtree(runs_dir / run)
    broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(out / "broker.log"))).start()
    try:
        bus = KafkaBus(broker.bootstrap)
        bus.create_topics(partitions_by_topic(run))
        prod = bus.producer()
        for i, value in enumerate(MALFORMED):
            prod.send_raw(Topics(run).tasks, value, key=f"malformed-{i}".encode())
        prod.flush()
        cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--bootstrap", broker.bootstrap, "--run", run,
               "--runs-dir", str(runs_dir), "--no-dashboard", "--restarts", "100", "--limit", str(a.tasks),
               "--drain-seconds", "120"]  # a learner restarted often has a backlog left when the last task is answered
        print("running: " + " ".join(cmd), flush=True)
        stop, kills, t0 = threading.Event(), [], time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        thread = threading.Thread(target=killer, args=(run, a.kills, a.every, stop, kills, t0), daemon=True)
        started = False
        with open(out / "up.log", "w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                print(f"  | {line}", end="", flush=True)
                if not started and line.startswith("[4/4]"):
                    started = True
                    t0 = time.monotonic()
                    thread.start()
        rc = proc.wait()
        stop.set()
        wall = time.monotonic() - t0
        result = {"bench": "chaos", "mode": "quick" if a.quick else "full", "command": cmd, "rc": rc,
                  "wall_s": wall, "machine": machine(), "kills": kills, "kills_by_role": dict(Counter(k["role"]
                                                                                                   for k in kills)),
                  **account(broker.bootstrap, run, runs_dir / run, len(MALFORMED))}
    finally:
        broker.stop()
    r = result
    r["goals"] = {"lost": len(r["lost"]) == 0, "trained_twice": not r["trained_twice"],
                  "stale_drops": r["stale_drops"] == 0, "letters_sent_twice": r["letters_sent_twice"] == 0,
                  "kills": len(kills) >= a.kills,
                  "malformed_dead_lettered": r["malformed_dead_lettered"] == r["malformed_published"]}
    r["goals_met"] = all(r["goals"].values())
    save_json(r, out / "chaos.json")
    shown = ("kills_by_role", "tasks", "trained_once", "trained_twice", "buffered_in_last_checkpoint",
             "dead_lettered_tasks", "malformed_dead_lettered", "letters_sent_twice", "stale_drops", "lost", "goals_met")
    print(json.dumps({k: r[k] for k in shown}, default=str))
    print(f"saved {out / 'chaos.json'}")
    return 0 if rc == 0 else rc


if __name__ == "__main__":
    raise SystemExit(main())

"""Chaos faults, injected for real into a running `sao up`: finding its roles, signals, bad records on its topics.

The roles are found as `sao up`'s own child processes (`/proc/<pid>/task/*/children`): each is
`python -m streamer.launch.cli <command> --config <file> ...`, an agent named by its `--status-file agent-<i>.json`,
and the embedded broker (when `sao up` started one) is its `tansu` child. A fault whose role cannot be found
within `find_timeout_s` is logged as missed, never silently dropped.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from msgspec import msgpack

from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.schema import SCHEMA_VERSION
from streamer.wire.topics import Topics

COMMAND_ROLE = {"learn": "learner", "metrics": "metrics", "simulate": "simulator", "replay": "simulator",
                "eval": "eval", "dashboard": "dashboard"}
BAD_PREFIX = "chaos-bad"  # key and id prefix of every bad record (never a real task's id)


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (every thread's children: Popen from any thread)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(out))


def role_of(argv: list[str]) -> str | None:
    """The role a `sao up` child runs, from its command line (None: not a role)."""
    if argv and Path(argv[0]).name == "tansu":
        return "broker"
    if "streamer.launch.cli" not in argv[:-1]:
        return None
    command = argv[argv.index("streamer.launch.cli") + 1]
    if command == "agent" and "--status-file" in argv[:-1]:
        return Path(argv[argv.index("--status-file") + 1]).stem  # agent-<i>
    return COMMAND_ROLE.get(command)


def role_pids(up_pid: int) -> dict[str, int]:
    """role name -> pid of each live child of the `sao up` process `up_pid`."""
    out: dict[str, int] = {}
    for pid in children(up_pid):
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        role = role_of(argv)
        if role is not None and state != "Z":  # a zombie is a dead role the supervisor has not reaped yet
            out[role] = pid
    return out


@dataclass
class Fault:
    """One fault of the plan: at `at_s` seconds after the roles started, `kind` on `role`."""

    at_s: float
    kind: str  # "sigkill", "sigstop" (SIGCONT after pause_s), "bad_records"
    role: str = ""  # learner, agent-<i>, metrics, broker; "" for bad_records
    pause_s: float = 0.0
    done: dict[str, Any] = field(default_factory=dict)  # what happened: wall times, pid, or why it was missed

    @property
    def fault_class(self) -> str:
        role = "agent" if self.role.startswith("agent-") else self.role
        return f"{self.kind}_{role}" if role else self.kind


class Injector:
    """Runs a fault plan against the `sao up` process `up_pid` in a thread; `faults[i].done` says what happened."""

    def __init__(self, up_pid: int, faults: list[Fault], bad_records: Callable[[], list[dict[str, Any]]],
                 find_timeout_s: float = 60.0) -> None:
        self.up_pid, self.faults, self.bad_records = up_pid, sorted(faults, key=lambda f: f.at_s), bad_records
        self.find_timeout_s = find_timeout_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-injector", daemon=True)
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.thread.start()

    def _run(self) -> None:
        for f in self.faults:
            if self.stop.wait(max(0.0, self.t0 + f.at_s - time.monotonic())):
                f.done = {"missed": "the run ended before this fault's time"}
                continue
            try:
                f.done = self.inject(f)
            except Exception as e:  # noqa: BLE001 -- recorded as missed and fails the bench's goals
                f.done = {"missed": f"{type(e).__name__}: {e}"}
            print(f"chaos: {f.kind} {f.role} at {f.at_s:.0f} s: {f.done}", flush=True)

    def inject(self, f: Fault) -> dict[str, Any]:
        if f.kind == "bad_records":
            return {"wall": time.time(), "records": self.bad_records()}
        pid = self.find(f.role)
        if pid is None:
            return {"missed": f"no live {f.role} child of sao up (pid {self.up_pid}) within {self.find_timeout_s} s"}
        wall = time.time()
        if f.kind == "sigkill":
            os.kill(pid, signal.SIGKILL)
            return {"wall": wall, "pid": pid, "new_pid": self.restarted(f.role, pid)}
        os.kill(pid, signal.SIGSTOP)
        self.stop.wait(f.pause_s)
        os.kill(pid, signal.SIGCONT)
        return {"wall": wall, "pid": pid, "cont_wall": time.time()}

    def find(self, role: str) -> int | None:
        deadline = time.monotonic() + self.find_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            pid = role_pids(self.up_pid).get(role)
            if pid is not None:
                return pid
            time.sleep(0.2)
        return None

    def restarted(self, role: str, old: int, timeout_s: float = 30.0) -> int | None:
        """The pid of the role's restarted process (None: not restarted within timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            pid = role_pids(self.up_pid).get(role)
            if pid is not None and pid != old:
                return pid
            time.sleep(0.2)
        return None

    def log(self) -> list[dict[str, Any]]:
        return [{**asdict(f), "fault_class": f.fault_class} for f in self.faults]


def bad_messages(run: str, t: float) -> dict[str, list[tuple[str, bytes]]]:
    """topic -> (what, bytes) of the bad records written to each consumed topic: bytes that do not decode, a record
    of the wrong type, and one that decodes but lies (values the issue's item 3 lists)."""
    topics, ids = Topics(run), f"{BAD_PREFIX}-{int(t)}"
    # plain dicts, msgpack-encoded: the structs' own checks would refuse to build what a hostile producer sends
    lying_traj = {"v": SCHEMA_VERSION, "traj_id": f"{ids}-traj", "task_id": f"{ids}-traj", "family": "arith",
                  "concept": "add", "prompt_len": 1, "tokens": [1, 2, 3], "loss_mask": [0, 1000000, 1],
                  "logprobs": [0.0, 5.0, -1.0], "temperature": 1e-30, "reward": 1e39, "policy_version": 10**15,
                  "group_size": 10**9}
    lying_task = {"v": SCHEMA_VERSION, "task_id": f"{ids}-task", "family": "no-such-family", "concept": "none",
                  "prompt": "", "answer": "", "spec": {"latency_s": math.inf}}
    forged_policy = {"v": SCHEMA_VERSION, "version": 10**15, "uri": "/etc", "sha256": "0" * 64, "step": 10**15,
                     "created_at": t}
    lying_learner = {"v": SCHEMA_VERSION, "step": -1, "version": 10**15, "time": math.nan, "n_trajectories": -5,
                     "n_tokens": -1, "task_ids": [f"{ids}-learner"]}
    enc, garbage, wrong_type = msgpack.encode, b"\x00not msgpack", b"\x82\xa1v\x01\xa7task_id\xa1x"
    return {
        topics.tasks: [("undecodable", garbage), ("missing fields", wrong_type), ("lying task", enc(lying_task))],
        topics.trajectories: [("undecodable", garbage), ("lying trajectory", enc(lying_traj))],
        topics.policy: [("undecodable", garbage), ("forged unsigned announcement", enc(forged_policy))],
        topics.learner: [("undecodable", garbage), ("lying learner event", enc(lying_learner))],
    }


def send_bad_records(bootstrap: str, run: str) -> list[dict[str, Any]]:
    """Writes `bad_messages` to the run's topics; returns each record's topic, partition, offset and what it is."""
    bus = KafkaBus(bootstrap)
    producer, sent, t = bus.producer(), [], time.time()
    for topic, records in bad_messages(run, t).items():
        for i, (what, value) in enumerate(records):
            future = producer.send_raw(topic, value, key=f"{BAD_PREFIX}-{i}".encode())
            sent.append((topic, what, future))
    producer.flush()
    out = []
    for topic, what, future in sent:
        meta = future.get(timeout=30)
        out.append({"topic": topic, "partition": meta.partition, "offset": meta.offset, "what": what})
    producer.close()
    return out

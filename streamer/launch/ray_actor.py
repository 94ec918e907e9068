"""The Ray actor that runs one role of the pipeline (`sao <argv>`) as its child process.

Ray restarts the actor when it dies (its process or node lost, or `ray.kill(actor, no_restart=False)`);
the child gets SIGKILL with its actor (PR_SET_PDEATHSIG), so a restarted learner never trains next to
an orphaned copy of itself. The driver side is `streamer.launch.ray_launch`.

The run's files travel by value: the actor writes the driver's `files` (config.yaml) into its node's own run
directory (the driver's path, or `$SAO_NODE_RUNS_DIR/<run>` where the node sets it) and runs the role on that copy,
so no node needs the driver's filesystem.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from streamer.transport.broker import free_port

SAO = ["-m", "streamer.launch.cli"]  # python arguments that run `sao <argv>`
USAGE_ERROR = 2  # the exit status of `sao <cmd>` (and argparse) on a bad command line or config
NODE_RUNS_DIR = "SAO_NODE_RUNS_DIR"  # a node's own runs directory (where its actors keep their run's files)


def node_run_dir(run_dir: str) -> str:
    """This node's directory for the driver's `run_dir`: `$SAO_NODE_RUNS_DIR/<run>` where set, else the same path."""
    base = os.environ.get(NODE_RUNS_DIR, "")
    return str(Path(base, Path(run_dir).name)) if base and run_dir else run_dir


def write_files(run_dir: str, files: dict[str, str]) -> None:
    """The run's files (name -> text) into `run_dir`, each replaced atomically (the ranks of a node write the same)."""
    for name, text in files.items():
        path = Path(run_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


def _child_setup() -> None:
    """In the role's process: signals as in a shell (a Ray worker blocks/ignores some, and a child inherits
    that), and SIGKILL when the actor dies, so no orphaned learner trains next to its restarted self."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: an orphaned role lives on until stopped by hand


def moved(arg: str, old: str, new: str) -> str:
    """`arg` (a path, or KEY=path) with the directory `old` at its start replaced by `new`."""
    key, eq, path = ("", "", arg) if arg.startswith(old) else arg.partition("=")
    return key + eq + new + path[len(old):] if (path + "/").startswith(old + "/") else arg


class RoleActor:
    """One role (`sao <argv>`) as a child of this actor. Wrapped by `ray.remote` in `streamer.launch.ray_launch`.

    When the child dies by a signal, or fails after running `min_uptime_s` (but not with a usage or
    config error, status 2), the actor exits so that Ray restarts it (and the role). A gang rank
    (autostart=False) waits for the driver's `start(env)` instead, and is restarted by the driver.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: str, cwd: str,
                 min_uptime_s: float = 10.0, autostart: bool = True, entry: list[str] | None = None,
                 driver_node: str = "", run_dir: str = "", files: dict[str, str] | None = None) -> None:
        self.name, self.run_dir = name, node_run_dir(run_dir)
        if files:  # the config by value: the role reads this node's copy
            write_files(self.run_dir, files)
        if self.run_dir != run_dir:  # paths in the driver's run directory (or KEY=path) -> the same in this node's
            argv, log_dir = [moved(a, run_dir, self.run_dir) for a in argv], moved(log_dir, run_dir, self.run_dir)
        self.argv, self.env = list(argv), dict(env)
        self.entry = list(SAO if entry is None else entry)
        # on another node than the driver's: its own directory, `<log_dir>/<hostname>/` (a local disk, or a shared
        # one where every host keeps to its own directory)
        away = driver_node and driver_node != self.where()["node_id"]
        self.log_path = Path(log_dir, *([socket.gethostname()] if away else []), f"{name}.log")
        self.cwd = cwd if cwd and Path(cwd).is_dir() else None  # "" or not on this host: the actor's own cwd
        self.min_uptime_s, self.autostart = min_uptime_s, autostart
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        self.started = 0.0
        self.failed_fast = False
        if autostart:
            self.start()

    def start(self, env: dict[str, str] | None = None) -> int:
        """Start (or, stopped, start again) the role; returns its pid."""
        if self.proc is not None and self.proc.poll() is None:
            return self.proc.pid
        self.env.update(env or {})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} {self.name} on {socket.gethostname()} "
                      f"(actor pid {os.getpid()}): sao {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, *self.entry, *self.argv], stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.cwd, preexec_fn=_child_setup,
                                         env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"})
        self.stopping, self.failed_fast, self.started = False, False, time.time()
        threading.Thread(target=self._watch, args=(self.proc,), daemon=True).start()
        return self.proc.pid

    def _watch(self, proc: subprocess.Popen) -> None:
        rc = proc.wait()
        if self.stopping or rc == 0 or proc is not self.proc:
            return
        if rc == USAGE_ERROR or (rc > 0 and time.time() - self.started < self.min_uptime_s):
            self.failed_fast = True  # a bad config, or an error at start-up: restarting would only loop
        elif self.autostart:
            os._exit(1)  # the actor dies with its role: Ray restarts both (a gang rank: the driver restarts)

    def status(self) -> dict[str, Any]:
        import ray

        rc = None if self.proc is None else self.proc.poll()
        state = "idle" if self.proc is None else "running" if rc is None else "exited"
        return {"name": self.name, "state": state, "returncode": rc, "pid": self.proc.pid if self.proc else None,
                "actor_pid": os.getpid(), "node": ray.util.get_node_ip_address(), "started": self.started,
                "argv": self.argv, "run_dir": self.run_dir,
                "failed_fast": self.failed_fast,
                "reconstructed": ray.get_runtime_context().was_current_actor_reconstructed}

    def where(self) -> dict[str, Any]:
        """This actor's node (id, IP, hostname) and the GPUs Ray gave it (ids as in CUDA_VISIBLE_DEVICES)."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "gpus": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}

    def probe(self, op: str, path: str, *args: Any) -> Any:
        """`streamer.transport.shared.<op>(path, *args)` on this host, a relative path taken from the role's cwd."""
        from streamer.transport import shared

        if op not in ("mark", "unseen", "unmark", "present"):
            raise ValueError(f"probe: unknown operation {op!r}")
        return getattr(shared, op)(Path(self.cwd or os.getcwd(), path), *args)

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, a free port on it): MASTER_ADDR/PORT when this actor is rank 0."""
        import ray

        return ray.util.get_node_ip_address(), free_port("")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT (the roles checkpoint / commit and exit), SIGKILL after `timeout` s."""
        self.stopping = True
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

"""The Ray actor that runs one role of the pipeline (`sao <argv>`) as its child process.

Ray restarts the actor when it dies (its process or node lost, or `ray.kill(actor, no_restart=False)`);
the child gets SIGKILL with its actor (PR_SET_PDEATHSIG), so a restarted learner never trains next to
an orphaned copy of itself. The driver side is `streamer.launch.ray_launch`.
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

SAO = ["-m", "streamer.launch.cli"]  # python arguments that run `sao <argv>`
USAGE_ERROR = 2  # the exit status of `sao <cmd>` (and argparse) on a bad command line or config


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


class RoleActor:
    """One role (`sao <argv>`) as a child of this actor. Wrapped by `ray.remote` in `streamer.launch.ray_launch`.

    When the child dies by a signal, or fails after running `min_uptime_s` (but not with a usage or
    config error, status 2), the actor exits so that Ray restarts it (and the role). A gang rank
    (autostart=False) waits for the driver's `start(env)` instead, and is restarted by the driver.
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: str, cwd: str,
                 min_uptime_s: float = 10.0, autostart: bool = True, entry: list[str] | None = None,
                 driver_node: str = "") -> None:
        self.name, self.argv, self.env = name, list(argv), dict(env)
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

        addr = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return addr, s.getsockname()[1]

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

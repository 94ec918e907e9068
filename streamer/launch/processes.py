"""Run the pipeline's roles as child processes: start, watch, restart a crashed one, stop (SIGINT, then SIGKILL).

A role that dies (a non-zero exit, or a signal such as SIGKILL) is started again with the same arguments, up to
`restarts` times per role; each restart resumes from what the role persisted (the learner from its checkpoint, an
agent from its consumer group's committed offsets). A role marked `restartable=False` (the simulator, which would
publish its stream again) fails the run instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamer.wire.config import FINAL_EXIT_CODES


@dataclass
class Role:
    name: str
    argv: list[str]  # arguments after `sao`
    required: bool = True  # the run fails when a required role dies
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment (thread caps)
    nice: int = 0  # CPU priority increment: roles other than the learner yield to it
    restartable: bool = True
    restarts: int = 0  # times this role has been started again after dying
    proc: subprocess.Popen | None = field(default=None, repr=False)


class Supervisor:
    """Starts `sao <argv>` for each role with its output in `<log_dir>/<name>.log`."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, restarts: int = 0) -> None:
        self.restarts = restarts  # per role
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.roles: list[Role] = []

    def start(self, role: Role) -> Role:
        self._spawn(role)
        self.roles.append(role)
        return role

    def _spawn(self, role: Role) -> None:
        log = open(self.log_dir / f"{role.name}.log", "ab")
        cmd = [sys.executable, "-m", "streamer.launch.cli", *role.argv]
        nice = (lambda: os.nice(role.nice)) if role.nice else None
        role.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **role.env},
                                     start_new_session=True,  # Ctrl-C reaches us only; we stop children in order
                                     preexec_fn=nice)
        log.close()

    def restart_dead(self) -> list[tuple[Role, int]]:
        """Start again every restartable role that died and has restarts left; returns (role, its exit code)."""
        out = []
        for r in self.roles:
            code = r.proc.poll()
            if code not in (None, 0, *FINAL_EXIT_CODES) and r.restartable and r.restarts < self.restarts:
                r.restarts += 1
                with open(self.log_dir / f"{r.name}.log", "ab") as log:
                    log.write(f"\n--- exited {code}: restart {r.restarts} of {self.restarts} ---\n".encode())
                self._spawn(r)
                out.append((r, code))
        return out

    def failed(self) -> list[Role]:
        """Required roles that exited with an error and will not be started again."""
        return [r for r in self.roles if r.required and r.proc.poll() not in (None, 0)
                and (r.proc.poll() in FINAL_EXIT_CODES or not (r.restartable and r.restarts < self.restarts))]

    def tail(self, role: Role, lines: int = 20) -> str:
        text = (self.log_dir / f"{role.name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, role: Role, timeout: float = 10.0) -> int | None:
        if role.proc is None or role.proc.poll() is not None:
            return None if role.proc is None else role.proc.returncode
        role.proc.send_signal(signal.SIGINT)
        try:
            return role.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            role.proc.kill()
            return role.proc.wait()

    def stop_all(self, timeout: float = 10.0) -> None:
        for role in reversed(self.roles):  # consumers of a role stop before it
            self.stop(role, timeout)

    def wait(self, role: Role, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while role.proc.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{role.name} still running after {timeout} s")
            time.sleep(0.2)
        return role.proc.returncode

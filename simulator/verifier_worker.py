"""User verifiers run in a worker process, under a time limit (`AgentSettings.verifier_timeout_s`).

A user verifier is code the run enabled but cannot bound: one that loops, in the agent's process, would hold the
GIL, stop the consumer's heartbeats, and its task would go to the next agent, which would hang on it in turn. So
user verifiers run in one persistent worker process (`python -m simulator.verifier_worker`), started at the first
call. The caller waits for the answer on a pipe (in `select`, so the GIL is free and the heartbeat thread runs);
past the limit it kills the worker (SIGKILL) and raises VerifierTimeout, and the next call starts a fresh worker.
Requests and answers are JSON lines (nothing is unpickled). The worker loads the verifiers the caller enabled by
their entry points' `module:attr` values, which come from installed packages' metadata, never from a message.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger("simulator.verifier_worker")

START_TIMEOUT_S = 60.0  # the worker's start (Python, then the plugins' imports); not counted in a call's limit


class VerifierTimeout(ValueError):
    """A verifier ran past its time limit (a ValueError: the agent dead-letters the task, as for any task fault)."""


class WorkerError(RuntimeError):
    """The worker died or answered something that is not a reply (the verifier crashed the process)."""


class Worker:
    """One worker process for the user verifiers `sources` ({name: "module:attr"}); thread-safe (calls queue)."""

    def __init__(self, sources: dict[str, str], timeout_s: float) -> None:
        self.sources, self.timeout_s = dict(sources), timeout_s
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self.restarts = 0  # workers killed for running past the limit, or found dead

    def score(self, name: str, answer: str, reference: str, params: dict[str, Any]) -> float:
        """The verifier's value (any number; the caller checks its range). Raises VerifierTimeout past the limit,
        WorkerError if the worker died, ValueError with the verifier's own error if it raised."""
        with self._lock:  # the limit starts once this call has the worker to itself
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            self._send(proc, {"name": name, "answer": answer, "reference": reference, "params": params})
            reply = self._receive(proc, self.timeout_s)
            if reply is None:
                self._kill()
                raise VerifierTimeout(f"verifier '{name}' ran past its limit of {self.timeout_s:g} s "
                                      f"(agent.verifier_timeout_s)")
        if "error" in reply:
            raise ValueError(reply["error"])
        return float(reply["value"])

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _start(self) -> subprocess.Popen:
        self._kill()
        proc = subprocess.Popen([sys.executable, "-m", "simulator.verifier_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, bufsize=0)
        self._proc, self._buf = proc, b""
        self._send(proc, {"path": sys.path, "sources": self.sources})
        reply = self._receive(proc, START_TIMEOUT_S)
        if reply is None or "error" in reply:
            self._kill()
            raise WorkerError(f"verifier worker did not start: {(reply or {}).get('error', 'no answer')}")
        return proc

    def _send(self, proc: subprocess.Popen, msg: dict[str, Any]) -> None:
        try:
            proc.stdin.write(json.dumps(msg).encode() + b"\n")
        except OSError as e:
            self._kill()
            raise WorkerError(f"verifier worker gone: {e}") from None

    def _receive(self, proc: subprocess.Popen, timeout_s: float) -> dict[str, Any] | None:
        """The next reply line, or None past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._kill()
                raise WorkerError("verifier worker exited (the verifier ended its process)")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            self._kill()
            raise WorkerError(f"verifier worker answered {line[:80]!r}") from None

    def _kill(self) -> None:
        proc, self._proc, self._buf = self._proc, None, b""
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            self.restarts += 1
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


# ----------------------------------------------------------------------------------------- the worker's side

def _load(sources: dict[str, str]) -> dict[str, Any]:
    from importlib.metadata import EntryPoint

    return {name: EntryPoint(name=name, value=value, group="sao_lab.verifiers").load()
            for name, value in sources.items()}


def _answer(fns: dict[str, Any], req: dict[str, Any]) -> dict[str, Any]:
    try:
        value = float(fns[req["name"]](req["answer"], req["reference"], req["params"]))
    except Exception as e:  # noqa: BLE001 - the verifier's bug, reported to the caller (it scores 0)
        return {"error": f"verifier '{req.get('name')}' raised {type(e).__name__}: {e}"}
    return {"value": value if value == value else -1.0}  # NaN is out of range: the caller scores it 0


def _orphan_watch(parent: int) -> None:
    """End the worker when its caller is gone, even while a verifier loops (EOF on stdin is read only between
    calls): a killed agent leaves no worker spinning."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the agent's to handle; EOF on stdin ends us
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # a verifier's prints go to stderr, not into the replies
    hello = json.loads(sys.stdin.readline() or "{}")
    sys.path[:] = hello.get("path", sys.path)
    try:
        fns = _load(hello.get("sources", {}))
    except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    out.write(json.dumps({"ready": sorted(fns)}) + "\n")
    for line in sys.stdin:
        out.write(json.dumps(_answer(fns, json.loads(line))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

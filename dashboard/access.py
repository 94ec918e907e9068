"""What a dashboard visitor may choose, and what only the operator sets.

The operator's settings (`DashboardSettings`: `sao dashboard`'s command line and the environment, read when the
server starts) are never taken from a visitor. A visitor picks runs by name (the sidebar, `?run=`): `run_dir`
confines each name to the runs root and refuses a path ('..', a separator, an absolute path) or a symlink that
leads out of it before anything under it is opened. The broker and the live run are the operator's; a visitor
may type them only when the server was started with `--allow-any-broker`, and then only a short list of
host:port servers (each pair a live reader: `dashboard.live.LiveTaps` holds at most `max_live`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from streamer.runs import artifacts as art
from streamer.wire.topics import check_run

MAX_SERVERS = 8  # bootstrap servers in one broker address a visitor may type


@dataclass(frozen=True)
class DashboardSettings:
    runs: str = "runs"  # the runs root: visitors open run directories inside it, nothing else
    bootstrap: str = ""  # broker of the live topics ("" -> none)
    run: str = ""  # run (topic prefix) tailed live
    refresh: float = 3.0  # seconds between live refreshes
    allow_any_broker: bool = False  # visitors may type a broker and a run (the server connects where they say)
    max_live: int = 4  # live readers (threads) held at once; the least recently used is stopped

    def live_target(self, typed_bootstrap: str, typed_run: str) -> tuple[str, str]:
        """The (broker, run) to tail: the operator's, or what the visitor typed when allowed."""
        return (typed_bootstrap, typed_run) if self.allow_any_broker else (self.bootstrap, self.run)


def settings_from_args(argv: list[str]) -> DashboardSettings:
    """The app's options (`sao dashboard` passes them after `--`); unknown arguments (a test runner's) are skipped."""
    p = argparse.ArgumentParser(prog="dashboard/app.py", allow_abbrev=False, add_help=False)
    p.add_argument("--runs", default=os.environ.get("SAO_RUNS_DIR", "runs"))
    p.add_argument("--bootstrap", default=os.environ.get("SAO_BOOTSTRAP", ""))
    p.add_argument("--run", default="")
    p.add_argument("--refresh", type=float, default=3.0)
    p.add_argument("--allow-any-broker", action="store_true")
    p.add_argument("--max-live", type=int, default=DashboardSettings.max_live)
    a = p.parse_known_args(argv)[0]
    return DashboardSettings(runs=a.runs, bootstrap=a.bootstrap, run=a.run, refresh=a.refresh,
                             allow_any_broker=a.allow_any_broker, max_live=max(1, a.max_live))


class Refused(ValueError):
    """A visitor's choice outside what the server allows (the message says what and why)."""


def run_dir(root: str | Path, name: str) -> Path:
    """The run directory `name` inside `root`; `Refused` for anything that is not a plain name of one in it."""
    base = Path(root).resolve()
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        why = "an absolute path" if name.startswith(("/", "\\")) else "a path, not a run name"
        raise Refused(f"run {name!r} refused: {why}; only runs inside the runs directory {base} can be opened")
    d = base / name
    if not _inside(base, d):
        raise Refused(f"run {name!r} refused: it is a symlink to {d.resolve()}, outside the runs directory {base}")
    return d


def list_runs(root: str | Path) -> list[str]:
    """Names of the run directories inside `root`, newest first; a symlink leading out of it is not offered."""
    base = Path(root).resolve()
    return [d.name for d in art.list_runs(base) if _inside(base, d)]


def _inside(base: Path, d: Path) -> bool:
    real = d.resolve()
    return real != base and real.is_relative_to(base)


def check_broker(bootstrap: str) -> str:
    """A broker address typed by a visitor: at most MAX_SERVERS host:port servers, else `Refused`."""
    servers = [s.strip() for s in bootstrap.split(",") if s.strip()]
    if not servers or len(servers) > MAX_SERVERS:
        raise Refused(f"broker {bootstrap[:80]!r} refused: give 1 to {MAX_SERVERS} host:port servers")
    for s in servers:
        host, _, port = s.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise Refused(f"broker server {s[:80]!r} refused: expected host:port with a TCP port")
    return ",".join(servers)


def check_live_run(run: str) -> str:
    try:
        return check_run(run)
    except ValueError as e:
        raise Refused(str(e)) from None

"""Is a path the same directory on every host? A check at start for settings that need a shared filesystem.

Each host (a Ray node, a torchrun rank) writes a marker file named by a fresh token and its own name into the
path, then every host looks for the others' markers; a marker not seen means that host has a different
directory under the same path (a local disk, not a shared mount). The caller runs `mark`, `unseen` and `unmark`
on each host (Ray actors, the ranks of a process group) and raises `not_shared(...)`'s message. A path every host
only reads (a model directory, the run's config.yaml) is checked with `present` instead.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

PREFIX = ".sao-shared-"


def marker(token: str, host: str) -> str:
    return PREFIX + token + "-" + re.sub(r"[^A-Za-z0-9_.-]", "_", host)


def mark(path: str | Path, name: str) -> str:
    """Write marker `name` into `path` (made if missing); "" or the reason it could not be written."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with open(Path(path) / name, "w") as f:
            f.write(f"{socket.gethostname()} pid {os.getpid()}\n")
        return ""
    except OSError as e:
        return f"cannot write into it: {e}"


def unseen(path: str | Path, names: list[str]) -> list[str]:
    """The markers among `names` that are not in `path` (as this host sees it)."""
    return [n for n in names if not (Path(path) / n).exists()]


def unmark(path: str | Path, name: str) -> None:
    try:
        (Path(path) / name).unlink()
    except OSError:
        pass


def present(path: str | Path) -> bool:
    return Path(path).exists()


def not_shared(setting: str, path: str, problems: dict[str, str], fix: str) -> str:
    """The error naming the setting, the path, what each host saw and the fix."""
    seen = "; ".join(f"{host}: {why}" for host, why in sorted(problems.items()))
    return f"{setting}={path} must be one directory shared by every host, and it is not ({seen}): {fix}"


def check(setting: str, path: str, fix: str, hosts: list[str], call_all, writes: bool = True,
          token: str = "") -> str:
    """"" when every host in `hosts` sees the same directory at `path`, else the error (`not_shared`).

    `call_all(op, {host: args})` runs this module's function `op` ("mark", "unseen", "unmark", "present") with
    those args on each host, in parallel where it can, and returns {host: result}. `writes`: the hosts write into
    the path and read each other's files (markers); otherwise they only read it (it must exist on each)."""
    if not writes:
        found = call_all("present", {h: (path,) for h in hosts})
        return not_shared(setting, path, {h: "not found" for h, ok in found.items() if not ok}, fix) \
            if not all(found.values()) else ""
    if len(hosts) < 2:
        return ""
    import uuid

    token = token or uuid.uuid4().hex[:12]
    names = {h: marker(token, h) for h in hosts}
    owner = {n: h for h, n in names.items()}
    problems = {h: why for h, why in call_all("mark", {h: (path, names[h]) for h in hosts}).items() if why}
    try:
        if not problems:
            missing = call_all("unseen", {h: (path, [n for o, n in names.items() if o != h]) for h in hosts})
            problems = {h: "does not see the files of " + ", ".join(owner[n] for n in gone)
                        for h, gone in missing.items() if gone}
    finally:
        call_all("unmark", {h: (path, names[h]) for h in hosts})
    return not_shared(setting, path, problems, fix) if problems else ""

"""What the benchmarks and the experiments (which import it) share: the machine and checkout a result was measured on,
JSON results and headless figures."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from streamer.runs.layout import finite  # NaN/inf -> null, numpy scalars -> Python, recursively


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()


def git_commit() -> str | None:
    """The checkout's commit, "+changes" when its tracked files differ from it; None outside a git checkout."""
    try:
        return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2), "platform": platform.platform()}


def save_json(obj: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(obj), indent=1, sort_keys=False) + "\n")
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (the benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, title: str | None = None) -> Path:
    """Lay out, write the PNG (creating its folder) and free the figure."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

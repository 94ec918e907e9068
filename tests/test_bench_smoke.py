"""Smoke test of the headline experiments and bench/pipeline.py: `--quick` (what CI runs) runs the real pipeline
briefly (embedded broker, tiny warm start, agents, learner) and this checks only that each script writes well-formed
outputs (the JSON keys the README and the dashboards read, a PNG that is a PNG). Figures are not judged here: timing
and quality live in the experiments themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(script: str, out: Path) -> dict:
    """`script`: a file under the checkout (bench/pipeline.py) or a module run with -m (experiments.stability)."""
    target = [str(ROOT / script)] if script.endswith(".py") else ["-m", script]
    proc = subprocess.run([sys.executable, *target, "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    name = Path(script).stem if script.endswith(".py") else script.rpartition(".")[2]
    png = out / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC, f"{png} is not a PNG"
    result = json.loads((out / f"{name}.json").read_text())
    assert result["bench"] == name and result["mode"] == "quick"
    assert result["png"] == str(png)
    return result


@pytest.mark.slow
def test_stability_smoke(tmp_path):
    r = _run("experiments.stability", tmp_path)
    assert r["max_staleness"] == 8 and [x["algo"] for x in r["runs"]] == ["sao"]
    row = r["runs"][0]
    assert {"learner_steps", "staleness", "collapsed", "series", "masked"} <= set(row)
    assert row["trajectories"] > 0, row["stopped"]
    assert set(row["series"]) >= {"step", "reward"}


def check_pipeline(r: dict) -> None:
    assert {"figures", "goals", "goals_met", "pipeline", "isolated", "learner_threads", "machine", "command",
            "definitions", "series"} <= set(r)
    assert {"tokens_per_s_ratio", "trained_fraction", "learner_steps_per_1000_trajectories",
            "learner_busy_share"} <= set(r["figures"])
    assert set(r["goals"]) == {"tokens_per_s_ratio", "trained_fraction"}
    assert r["isolated"]["tokens_per_s"] > 0 and r["isolated"]["threads"] >= 1
    assert r["rc"] == 0 and r["pipeline"]["trajectories_generated"] > 0, r["stopped"]


@pytest.mark.slow
def test_pipeline_smoke(tmp_path):
    # --quick: the isolated step, then sao up with a 20-step warm start for ~25 s (<= 90 s in all)
    check_pipeline(_run("bench/pipeline.py", tmp_path))

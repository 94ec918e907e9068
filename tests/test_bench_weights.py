"""bench/weights.py --quick: the tiny model to 1 and 2 agent processes by each transport, and the JSON's shape
(the keys docs/results/weights.json is read by). Timings are not judged here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # 11 to 36 s measured on 2 shared cores: two agent processes start torch
def test_weights_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.weights", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    r = json.loads((tmp_path / "weights.json").read_text())
    assert r["bench"] == "weights" and r["mode"] == "quick" and r["png"] == str(tmp_path / "weights.png")
    assert (tmp_path / "weights.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"machine", "machine_after", "commit", "settings", "models", "rows", "table", "seconds"} <= set(r)
    tiny = r["models"]["tiny"]
    assert tiny["params"] > 3e6 and tiny["tensor_bytes"]["float32"] == 2 * tiny["tensor_bytes"]["bfloat16"]
    assert tiny["file_bytes"]["bfloat16"] < tiny["file_bytes"]["float32"]  # bf16 travels as bf16
    cells = {(x["dtype"], x["agents"], x["transport"]) for x in r["rows"]}
    assert cells == {(d, n, t) for d in ("float32", "bfloat16") for n in (1, 2)
                     for t in ("directory", "http", "broadcast")}
    for row in r["rows"]:
        assert row["seconds"] > 0 and row["publish_s"] > 0 and row["agent_load_s"] > 0
        assert row["by_broadcast"] == (1.0 if row["transport"] == "broadcast" else None), row
    assert r["table"].startswith("| model |") and r["models"]["tiny"]["broadcast"]["failed"] == 0

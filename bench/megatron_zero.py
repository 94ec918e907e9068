"""Optimizer state per rank of the megatron backend: replicated AdamW (today's) vs the sharded one (ZeRO-1).

    .venv/bin/python bench/megatron_zero.py [--out docs/results/megatron_zero.json]

Runs `learner.backends.megatron.zero_check` under torchrun (CPU processes, gloo) on the tiny Qwen3-MoE policy and
its critic at (EP 1, DP 2), (EP 2, DP 2, expert-DP 1) on 2 processes and (TP 2, DP 2: whole experts over expert-DP 4)
on 4: per rank the bytes of optimizer state and of parameters
with each optimizer, and the largest weight difference between the two after each of 3 steps. Writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(nproc: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "zero.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(_port()),
               "-m", "learner.backends.megatron.zero_check", "--out", str(out), *flags]
        env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
        res = json.loads(out.read_text())
    rep, sh = res["replicated"]["optimizer_state_bytes"], res["sharded"]["optimizer_state_bytes"]
    res["sharded_over_replicated"] = [round(s / r, 4) for s, r in zip(sh, rep)]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "megatron_zero.json"))
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = {"ep1_dp2": run(2, ["--ep", "1"]), "ep2_dp2": run(2, ["--ep", "2"]), "tp2_dp2": run(4, ["--tp", "2"])}
    doc = {"what": __doc__.splitlines()[0], "model": "tiny Qwen3-MoE (ModelConfig defaults) + critic, float32",
           "device": "cpu (gloo)", "layouts": rows, "wall_s": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for name, r in rows.items():
        print(f"{name}: optimizer state per rank {r['replicated']['optimizer_state_bytes'][0] / 2**20:.1f} MiB "
              f"replicated -> {r['sharded']['optimizer_state_bytes'][0] / 2**20:.1f} MiB sharded "
              f"(x{r['sharded_over_replicated'][0]}); weights equal after each step: {r['max_abs_per_step']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the KL anchor's kind set how often the policy still calls the new tool first when the rename comes?

One process (experiments/online.py: the real engine, environments, verifiers and learner step; batch 64, lag 1), the
default scenario's phases 0-2 (11,800 tasks: start, rule-and-format, tool-rename), from a given warm start, one seed
and one anchor per run. Per run: the share of tool tasks whose first call names the new tool (`find`) in the last 512
tool tasks before the rename and in blocks of 128 after it, the rename's recovery, and each phase's mean reward.

Its runs are in docs/results/runs/default/2026-12-05-kl-floor/.

    .venv/bin/python -m experiments.kl_floor OUT.json INIT SEED [--set KEY=VALUE ...]
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from experiments.online import online_run
from streamer.runs.adaptation import drift_recoveries

FIRST_CALL = re.compile(r"<call>(\w+)\(")


def first_tool(response: str) -> str:
    m = FIRST_CALL.search(response)
    return m.group(1) if m else "none"


def main(out: str, init: str, seed: int, sets: list[str]) -> None:
    t0 = time.monotonic()
    traj, steps, drifts = online_run(init, "default", sets, [], seed=seed, limit=11_800, log=lambda *_: None)
    tool = traj[traj["family"] == "tool"].copy()
    tool["first"] = tool["response"].map(first_tool)
    pre = tool[tool["phase"] == 1].tail(512)
    post = tool[tool["phase"] == 2].reset_index(drop=True).iloc[:1024]
    rec = drift_recoveries(traj, drifts, steps)
    rename = rec[(rec["family"] == "tool") & (rec["name"] == "tool-rename")].iloc[0]
    result = {
        "init": init, "seed": seed, "sets": sets, "wall_s": round(time.monotonic() - t0, 1),
        "find_first_last512_before": round(float((pre["first"] == "find").mean()), 4),
        "find_first_after_by_128": [round(float((b["first"] == "find").mean()), 4)
                                    for _, b in post.groupby(post.index // 128)],
        "rename": {"status": rename["status"], "trajectories": rename["trajectories"],
                   "learner_steps": rename["learner_steps"]},
        "recoveries": {f"{r['name']}/{r['family']}": [r["status"], r["trajectories"]]
                       for _, r in rec.iterrows() if r["status"] != "unaffected"},
        "phase_family_reward": {f"{p}/{f}": round(float(g["reward"].mean()), 4)
                                for (p, f), g in traj.groupby(["phase", "family"])},
        "kl_k3_mean": round(float(steps["learner/kl_k3"].mean()), 5) if "learner/kl_k3" in steps else None,
    }
    text = json.dumps(result, indent=1, default=lambda x: x.item() if hasattr(x, "item") else str(x))
    Path(out).write_text(text)
    print(text)


if __name__ == "__main__":
    args = sys.argv[1:]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    main(args[0], args[1], int(args[2]), sets)

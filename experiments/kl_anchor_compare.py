"""Per sao up run directory: AUC, recoveries, the rename's first blocks, reward after each phase's first 192 -> JSON.

Its figures are in docs/results/runs/default/2026-12-04-kl-anchor/.

    .venv/bin/python -m experiments.kl_anchor_compare OUT.json RUN_DIR...
"""

from __future__ import annotations

import json
import sys

import pandas as pd


def compare(run: str) -> dict:
    t = pd.read_parquet(run + '/trajectories.parquet').sort_values('seq')
    s = json.load(open(run + '/summary.json'))
    x = t[(t.family == 'tool') & (t.phase == 2)].reset_index(drop=True).iloc[:1024]
    first = [round(float(d), 4) for d in x.groupby(x.index // 128)['reward'].apply(lambda v: (v == 1).mean())]
    rest = {}
    for (ph, fam, con), g in t.groupby(['phase', 'family', 'concept']):
        g = g.iloc[192:]
        if len(g):
            rest[f"{ph}/{fam}/{con}"] = round(float(g.reward.mean()), 3)
    rec = {f"{v['name']}/{v['family']}": [v['status'], v['trajectories'], v['learner_steps']]
           for v in s['recoveries'] if v['status'] != 'unaffected'}
    return {"auc": round(s['auc'], 4), "recoveries": rec, "rename_new_tool_first_by_128": first,
            "phase_rest_reward": rest,
            "phase1_tool_reward": round(float(t[(t.family == 'tool') & (t.phase == 1)].reward.mean()), 4)}


def main(argv: list[str]) -> None:
    out = {}
    for r in argv[1:]:
        out[r] = compare(r)
        print(r, json.dumps(out[r]))
    json.dump(out, open(argv[0], 'w'), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])

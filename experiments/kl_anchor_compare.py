"""Per sao up run directory: AUC, recoveries, the rename's first blocks, reward after each phase's first 192 -> JSON.

    python compare.py OUT.json RUN_DIR...
"""
import json
import sys

import pandas as pd

out = {}
for r in sys.argv[2:]:
    t = pd.read_parquet(r + '/trajectories.parquet').sort_values('seq')
    s = json.load(open(r + '/summary.json'))
    x = t[(t.family == 'tool') & (t.phase == 2)].reset_index(drop=True).iloc[:1024]
    first = [round(float(d), 4) for d in x.groupby(x.index // 128)['reward'].apply(lambda v: (v == 1).mean())]
    rest = {}
    for (ph, fam, con), g in t.groupby(['phase', 'family', 'concept']):
        g = g.iloc[192:]
        if len(g):
            rest[f"{ph}/{fam}/{con}"] = round(float(g.reward.mean()), 3)
    rec = {f"{v['name']}/{v['family']}": [v['status'], v['trajectories'], v['learner_steps']]
           for v in s['recoveries'] if v['status'] != 'unaffected'}
    out[r] = {"auc": round(s['auc'], 4), "recoveries": rec, "rename_new_tool_first_by_128": first,
              "phase_rest_reward": rest,
              "phase1_tool_reward": round(float(t[(t.family == 'tool') & (t.phase == 1)].reward.mean()), 4)}
    print(r, json.dumps(out[r]))
json.dump(out, open(sys.argv[1], 'w'), indent=1)

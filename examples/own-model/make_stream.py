"""Writes stream.jsonl: 3,000 recorded support tasks in French under two sources, for `sao up --model DIR`.

`factures` (scored by `exact`) asks for the invoice code in square brackets, then, from row 600 on, in round
brackets: a drift of its `concept` tag (`crochets` -> `parentheses`). `tickets` (scored by `normalized_exact`)
always wants round brackets. The first 400 rows carry a `demonstration` (the answer an operator wrote), for the
supervised warm start of a model that has never seen the format (`finetune.rows` in run.yaml); one factures
demonstration in five already uses the new round brackets (some operators did), so the warm-started policy samples
the new format now and then, and training has a signal to recover from.

    python examples/own-model/make_stream.py
"""

import json
import random
from pathlib import Path

N, DRIFT, DEMOS = 3000, 600, 400

rng = random.Random(0)
rows = []
for i in range(N):
    code = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4)))
    if i % 2:
        source, verifier, concept, ref = "tickets", "normalized_exact", "parentheses", f"({code})"
        prompt = f"Ticket {code} : référence ?"
    else:
        source, verifier = "factures", "exact"
        concept, ref = ("crochets", f"[{code}]") if i < DRIFT else ("parentheses", f"({code})")
        prompt = f"Facture {code} : référence ?"
    row = {"task_id": f"fr-{i}", "prompt": prompt, "reference": ref, "verifier": verifier,
           "tags": {"source": source, "concept": concept}, "time": round(i * 0.05, 2)}
    if i < DEMOS:
        row["demonstration"] = f"({code})" if source == "factures" and rng.random() < 0.2 else ref
    rows.append(row)
out = Path(__file__).with_name("stream.jsonl")
out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
print(f"{out}: {len(rows)} rows")

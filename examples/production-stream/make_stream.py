"""Writes stream.jsonl: 640 recorded tasks whose expected answer format drifts from [x] to (x) after row 160.

Tags: source `tickets` (scored by the built-in `exact`) and `forms` (scored by the user verifier `wrapped`, half
credit for the right content in the wrong brackets).

    python examples/production-stream/make_stream.py
"""

import json
import random
from pathlib import Path

rng = random.Random(0)
rows = []
for i in range(640):
    word = "".join(rng.choice("abcdefghijkl") for _ in range(rng.randint(2, 5)))
    concept, ref = ("square", f"[{word}]") if i < 160 else ("round", f"({word})")
    source, verifier = ("tickets", "exact") if i % 2 else ("forms", "wrapped")
    rows.append({"task_id": f"ex-{i}", "prompt": f"f:{word}=", "reference": ref, "verifier": verifier,
                 "tags": {"source": source, "concept": concept}, "time": round(i * 0.05, 2)})
out = Path(__file__).with_name("stream.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"{out}: {len(rows)} rows")

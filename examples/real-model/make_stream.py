"""Writes stream.jsonl: 3,000 one-digit sums, then differences, for SmolLM2-135M-Instruct.

Source `arith`, verifier `numeric` (the last number in the answer must equal the reference: "2 + 8 = 10" and "The
answer is 10." both score 1; an answer cut at the token limit before its number scores 0). Rows before DRIFT ask for a
sum (concept `add`: "What is 4 + 3? Reply with only the number." -> 7); from row DRIFT on, for a difference of two
digits, the larger first (concept `sub`: "What is 9 - 4? ..." -> 5). `sao up --stream` reads the change of the
`concept` tag as a drift (`simulator.records.TagDrift`). No demonstrations: the model starts from its own answers.

    python examples/real-model/make_stream.py
"""

import json
import random
from pathlib import Path

N, DRIFT = 3000, 320

rng = random.Random(0)
rows = []
for i in range(N):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if i < DRIFT:
        concept, question, answer = "add", f"{a} + {b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        concept, question, answer = "sub", f"{a} - {b}", a - b
    rows.append({"task_id": f"arith-{i}", "prompt": f"What is {question}? Reply with only the number.",
                 "reference": str(answer), "verifier": "numeric", "tags": {"source": "arith", "concept": concept},
                 "time": round(i * 0.05, 2)})
out = Path(__file__).with_name("stream.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"{out}: {len(rows)} rows")
# sao up --config examples/real-model/run.yaml --model runs/models/smollm2 --stream examples/real-model/stream.jsonl
# (examples/real-model/README.md: sao import makes that model directory)

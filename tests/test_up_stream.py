"""`sao up --stream FILE`: the whole pipeline on a recorded production stream instead of the simulator.

The stream is smoke.yaml's drift written as production rows (verifier `exact`, tags source=fmt and concept
brackets then parens), plus one bad row: every good row is answered and trained on under its tags, and the bad
row is set aside into the run directory by row and field.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from streamer.runs.readers import read_learner, read_summary, read_trajectories

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

N_BRACKETS, N_PARENS = 128, 384


def stream_rows(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(N_BRACKETS + N_PARENS):
        word = "".join(rng.choice("abcdefghijkl") for _ in range(rng.randint(2, 5)))
        concept, ref = ("brackets", f"[{word}]") if i < N_BRACKETS else ("parens", f"({word})")
        rows.append({"task_id": f"s-{i}", "prompt": f"f:{word}=", "reference": ref, "verifier": "exact",
                     "tags": {"source": "fmt", "concept": concept}, "time": i * 0.05})
    rows.insert(10, {"task_id": "bad", "prompt": "f:ab=", "reference": "[ab]", "verifier": "no_such_verifier"})
    return rows


def test_up_on_a_recorded_stream_trains_under_its_tags(tmp_path):
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps(r) + "\n" for r in stream_rows()))
    cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--run", "s", "--runs-dir", str(tmp_path / "runs"),
           "--scenario", "smoke", "--stream", str(stream), "--no-dashboard", "--no-eval", "--agents", "1",
           "--cores", "2", "--batch", "64", "--set", "pretrain.steps=120", "--set", "pretrain.eval_every=0",
           "--max-seconds", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    run_dir = tmp_path / "runs" / "s"
    assert read_summary(run_dir)["stopped"] == "scenario finished: every task answered"
    trajs = read_trajectories(run_dir)
    assert len(trajs) == trajs["task_id"].nunique() == N_BRACKETS + N_PARENS
    assert set(trajs["family"]) == {"fmt"} and set(trajs["concept"]) == {"brackets", "parens"}
    assert len(read_learner(run_dir)) >= (N_BRACKETS + N_PARENS) // 64 - 1
    [reject] = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    assert (reject["row"], reject["field"]) == (11, "verifier")


def test_up_refuses_a_missing_stream_and_realtime_with_a_stream(tmp_path):
    from streamer.launch.up import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--stream", str(tmp_path / "none.jsonl")])
    (tmp_path / "s.jsonl").write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--stream", str(tmp_path / "s.jsonl"), "--realtime"])
    cfg = parse_args(["--stream", str(tmp_path / "s.jsonl"), "--speed", "2"])
    assert (cfg.launch.stream, cfg.launch.speed) == (str(tmp_path / "s.jsonl"), 2.0)


def own_model_rows(seed: int = 0) -> list[dict]:
    """Two sources with two verifiers: `billing` (numeric, abs_tol 0.5) drifts from `sum` to `diff` halfway,
    `support` (normalized exact) does not; prompts in French, outside the tiny model's alphabet."""
    rng = random.Random(seed)
    rows = []
    for i in range(192):
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        if i % 2:
            concept = "sum" if i < 96 else "diff"
            ref = a + b if concept == "sum" else a - b
            rows.append({"prompt": f"Facture n°{i}: {a} et {b} ?", "reference": str(ref), "verifier": "numeric",
                         "params": {"abs_tol": 0.5}, "tags": {"source": "billing", "concept": concept},
                         "time": i * 0.01})
        else:
            rows.append({"messages": [{"role": "system", "content": "Réponds par oui ou non."},
                                      {"role": "user", "content": f"Le colis {a} est-il arrivé ?"}],
                         "reference": "oui" if a % 2 else "non", "verifier": "normalized_exact",
                         "tags": {"source": "support", "concept": "status"}, "time": i * 0.01})
    rows.insert(7, {"prompt": "très long " * 400, "reference": "x", "verifier": "exact", "tags": {"source": "bad"}})
    return rows


@pytest.mark.parametrize("arch", ["qwen3", "glm4_moe"])
def test_up_with_an_own_model_on_an_own_stream(tmp_path, arch):
    """`sao up --model DIR --stream FILE`: a Qwen3 dense or GLM-4-MoE model with a BPE tokenizer and a chat template,
    built here, answers and trains on a French two-source stream; the billing source's tag drift is analysed as a
    drift."""
    from learner.models.toy import build_toy_model, stream_texts

    rows, stream, corpus = own_model_rows(), tmp_path / "stream.jsonl", tmp_path / "corpus.jsonl"
    stream.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    corpus.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows if r["tags"]["source"] != "bad"))
    model = build_toy_model(arch, stream_texts(corpus), tmp_path / "model", vocab_size=300)
    cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--run", "own", "--runs-dir", str(tmp_path / "runs"),
           "--model", str(model), "--stream", str(stream), "--no-dashboard", "--no-eval", "--agents", "1",
           "--cores", "2", "--batch", "32", "--set", "agent.max_new_tokens=8", "--max-seconds", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "no warm start" in proc.stdout
    run_dir = tmp_path / "runs" / "own"
    summary = read_summary(run_dir)
    assert summary["stopped"] == "scenario finished: every task answered"
    trajs = read_trajectories(run_dir)
    assert len(trajs) == trajs["task_id"].nunique() == 192
    assert set(trajs["family"]) == {"billing", "support"}
    assert set(trajs[trajs["family"] == "billing"]["concept"]) == {"sum", "diff"}
    assert len(read_learner(run_dir)) >= 192 // 32 - 1
    assert summary["n_drift_events"] == 1  # the billing tag's change, from the stream's tags
    by_family = {r["family"]: r for r in summary["recoveries"]}
    assert by_family["support"]["status"] == "unaffected" and by_family["billing"]["prev_concept"] == "sum"
    [reject] = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    assert (reject["row"], reject["field"]) == (8, "prompt") and "context of 1024" in reject["error"]
    published = sorted((run_dir / "weights").glob("v*"))[-1]
    assert (published / "tokenizer.json").is_file() and (published / "chat_template.jinja").is_file()

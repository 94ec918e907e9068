"""`learner.finetune`: supervised warm start of any HF model on a recorded stream's demonstrations."""

from __future__ import annotations

import json
import random

import pytest

from learner.finetune import FinetuneConfig, encode, finetune, read_demonstrations
from learner.models import CharTokenizer, load_tokenizer
from learner.models.toy import build_toy_model, stream_texts


def test_encode_trains_on_the_answer_only():
    tok = CharTokenizer()
    ids, mask = encode(tok, "f:ab=", None, "[ab]")
    assert ids == [tok.bos_id, *tok.encode("f:ab="), *tok.encode("[ab]"), tok.eos_id]
    assert mask == [0] * 6 + [1] * 5


def bracket_rows(n: int, demos: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4)))
        row = {"prompt": f"f:{word}=", "reference": f"[{word}]", "verifier": "exact",
               "tags": {"source": "forms", "concept": "square"}, "time": i * 0.1}
        rows.append({**row, "demonstration": f"[{word}]"} if i < demos else row)
    return rows


def test_read_demonstrations_takes_the_first_rows_and_names_what_it_leaves_out(tmp_path):
    rows = bracket_rows(10, demos=6)
    rows[2] = {**rows[2], "verifier": "no_such"}
    stream = tmp_path / "s.jsonl"
    stream.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    demos = read_demonstrations(stream, 5, log=lines.append)
    assert [d for _, _, d in demos] == [rows[i]["demonstration"] for i in (0, 1, 3, 4)]
    assert demos[0][0] == rows[0]["prompt"] and demos[0][1] is None
    [line] = lines
    assert line.startswith("finetune: left out 1 invalid row(s) of the first 5, first row 3: field 'verifier': "
                           "verifier 'no_such': unknown")


def test_finetune_teaches_a_random_model_the_streams_format_and_is_cached(tmp_path):
    rows = bracket_rows(300, demos=200)
    stream = tmp_path / "s.jsonl"
    stream.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = build_toy_model("qwen3", stream_texts(stream), tmp_path / "m", vocab_size=120)
    cfg = FinetuneConfig(rows=200, steps=300, batch_size=16, cache_dir=str(tmp_path / "cache"))
    out = finetune(model, stream, cfg, log=lambda line: None)
    meta = json.loads((out / "finetune.json").read_text())
    assert meta["demonstrations"] == 200 and meta["loss_last"] < 0.3 * meta["loss_first"]
    assert held_out_accuracy(out, rows[200:]) >= 0.5 > held_out_accuracy(model, rows[200:])
    lines = []
    assert finetune(model, stream, cfg, log=lines.append) == out and lines == [f"finetune: reusing {out}"]
    assert finetune(model, stream, FinetuneConfig(rows=0), log=lines.append) == model  # nothing to learn from


def held_out_accuracy(model_dir, rows: list[dict]) -> float:
    from learner.engines import make_engine
    from simulator.records import message_from_row, prompt_rule
    from streamer.agent.rollouts import run_tasks
    from streamer.wire.settings import AgentSettings

    tok, rule = load_tokenizer(model_dir), prompt_rule(model_dir, load_tokenizer)
    tasks = [message_from_row(r, rule=rule) for r in rows]
    s = AgentSettings(temperature=0.0, concurrency=len(tasks), max_new_tokens=8)
    return sum(t[0].reward for t in run_tasks(make_engine("torch", model_dir, tok), tok, tasks, s)) / len(tasks)


def test_up_refuses_finetune_rows_without_a_stream():
    from streamer.launch.run_config import load_run_config
    from streamer.wire.config import ConfigError

    with pytest.raises(ConfigError, match="finetune.rows: .* give --stream FILE"):
        load_run_config(None, ["finetune.rows=100"])

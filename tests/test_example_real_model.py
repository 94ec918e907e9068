"""examples/real-model: the stream file is what its script writes; every row validates against a model with a chat
template and its reference is the sum in the concept's form; the drift is where the README says; the run config
asks for LoRA and a value head; measure.py's windows and margins are computed as stated."""

from __future__ import annotations

import importlib.util
import json
import re
import runpy
import shutil
from pathlib import Path

import pandas as pd

from learner.models.tokenizer import load_tokenizer
from learner.models.toy import build_toy_model, stream_texts
from simulator import verifiers
from simulator.records import prompt_rule
from simulator.replay import replay
from simulator.sinks import QueueSink
from streamer.wire.schema import DriftEvent, Task

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "real-model"
QUESTION = re.compile(r"^What is (\d) ([+-]) (\d)\? Reply with only the number\.$")


def _measure():
    spec = importlib.util.spec_from_file_location("real_model_measure", EXAMPLE / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_file_is_what_make_stream_writes(tmp_path):
    shutil.copy(EXAMPLE / "make_stream.py", tmp_path / "make_stream.py")
    runpy.run_path(str(tmp_path / "make_stream.py"), run_name="__main__")
    assert (tmp_path / "stream.jsonl").read_bytes() == (EXAMPLE / "stream.jsonl").read_bytes()


def test_rows_validate_through_a_chat_template_and_drift_once_from_sums_to_differences(tmp_path):
    stream = EXAMPLE / "stream.jsonl"
    model = build_toy_model("qwen3", stream_texts(stream), tmp_path / "m", vocab_size=300)
    sink = QueueSink()
    stats = replay(stream, sink, speed=0, rule=prompt_rule(model, load_tokenizer))
    assert (stats.tasks, stats.bad, stats.drift_events) == (3000, 0, 1)
    msgs = sink.drain()
    [drift] = [m for m in msgs if isinstance(m, DriftEvent)]
    assert (drift.at_seq, drift.prev_concepts["arith"], drift.concepts["arith"]) == (320, "add", "sub")
    tasks = [m for m in msgs if isinstance(m, Task)]
    for t in tasks:
        a, op, b = QUESTION.match(t.prompt).groups()
        assert op == {"add": "+", "sub": "-"}[t.concept] and t.spec["verifier"] == "numeric"
        assert t.answer == str(int(a) + int(b) if op == "+" else int(a) - int(b)) and int(t.answer) >= 0
    assert [t.concept for t in tasks[:320]] == ["add"] * 320 and {t.concept for t in tasks[320:]} == {"sub"}


def test_numeric_scores_the_last_number_of_the_answer():
    # answers SmolLM2-135M-Instruct wrote (README): an equation or a sentence counts, a cut-off answer does not
    assert verifiers.score("numeric", "2 + 8 = 10", "10", {}) == 1.0
    assert verifiers.score("numeric", "The answer is 15.", "15", {}) == 1.0
    assert verifiers.score("numeric", "2 + 8 = 14", "10", {}) == 0.0
    assert verifiers.score("numeric", "The answer to 1 + 8 is ", "9", {}) == 0.0  # its last number is 8


def test_run_config_trains_lora_adapters_and_a_value_head():
    from streamer.launch.run_config import RunConfig
    from streamer.wire.config import load_config

    cfg = load_config(RunConfig, EXAMPLE / "run.yaml")
    assert cfg.learner.policy.lora.r > 0 and cfg.learner.value.kind == "head"
    assert cfg.learner.optim.lr > 1e-6  # above the pretrained profile's: the README says why


def test_window_means_and_margins_by_hand():
    m = _measure()
    df = pd.DataFrame({"reward": [0, 0, 1, 1, 1, 1], "success": [False, False, True, True, True, True]})
    w = m.window_means(df, 2)
    assert (w["reward_first"], w["reward_last"], w["reward_margin"], w["success_margin"], w["overlap"]) == (
        0.0, 1.0, 1.0, 1.0, False)
    w = m.window_means(df, 4)  # 0,0,1,1 against 1,1,1,1: they share two rows
    assert (w["reward_first"], w["reward_last"], w["reward_margin"], w["overlap"]) == (0.5, 1.0, 0.5, True)
    runs = {"a": {"overall": w, "concepts": {}}, "b": {"overall": {**w, "reward_margin": 0.1, "success_margin": 0.0},
                                                       "concepts": {}}}
    agg = m.over_seeds(runs)["overall"]
    assert (agg["reward_margin_mean"], agg["reward_margin_min"], agg["seeds"]) == (0.3, 0.1, 2)


def test_first_rows_per_concept_keeps_stream_order():
    m = _measure()
    rows = [{"tags": {"concept": c}, "i": i} for i, c in enumerate("aabab")]
    got = m.first_rows_per_concept(rows, 2)
    assert list(got) == ["a", "b"] and [r["i"] for r in got["a"]] == [0, 1] and [r["i"] for r in got["b"]] == [2, 4]


def test_measured_figures_are_the_ones_the_readme_quotes():
    path = EXAMPLE / "measured.json"
    measured, readme = json.loads(path.read_text()), (EXAMPLE / "README.md").read_text()
    for concept, v in measured["pretrained"]["concepts"].items():
        assert f"{concept} {v['success']:.2f}" in readme
    for name, agg in measured["over_seeds"].items():
        assert f"{name}: {agg['reward_margin_mean']:+.2f} (min {agg['reward_margin_min']:+.2f})" in readme


def test_value_options_runs_the_same_sao_up_with_the_critic_overridden():
    import sys

    sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("real_model_value_options", EXAMPLE / "value_options.py")
    vo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vo)
    m = _measure()
    base = m.up_command(Path("runs/models/smollm2"), 1, Path("runs/real-model"), 600)
    cmd = m.up_command(Path("runs/models/smollm2"), 1, Path("runs/real-model"), 600, "real-model-copy-8",
                       vo.OPTIONS["copy-8"])
    extra = cmd[len(base):]  # measure.py's command, the run renamed and the critic's keys added
    assert cmd[:len(base)] == [x.replace("real-model-s1", "real-model-copy-8-s1") for x in base]
    assert extra == ["--set", "learner.value.kind=copy", "--set", "learner.value.layers=8", "--set",
                     "learner.optim.value_lr=1e-5"]
    measured = json.loads((EXAMPLE / "value_options.json").read_text())
    assert set(measured["runs"]) == {"head", "copy", "copy-8"}
    assert all(set(seeds) == {"1", "2"} for seeds in measured["runs"].values())

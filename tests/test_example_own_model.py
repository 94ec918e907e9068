"""examples/own-model: the stream file is what its script writes; every row validates against a model built from it
(French prompts through its chat template); the demonstrations and the drift are where the README says; the run
config fine-tunes on them; its measured figures are the ones the README quotes."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

from learner.finetune import read_demonstrations
from learner.models.tokenizer import load_tokenizer
from learner.models.toy import build_toy_model, stream_texts
from simulator.records import prompt_rule
from simulator.replay import replay
from simulator.sinks import QueueSink
from streamer.wire.schema import DriftEvent

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own-model"


def test_stream_file_is_what_make_stream_writes(tmp_path):
    shutil.copy(EXAMPLE / "make_stream.py", tmp_path / "make_stream.py")
    runpy.run_path(str(tmp_path / "make_stream.py"), run_name="__main__")
    assert (tmp_path / "stream.jsonl").read_bytes() == (EXAMPLE / "stream.jsonl").read_bytes()


def test_rows_validate_for_a_model_of_your_own_and_drift_at_row_600(tmp_path):
    stream = EXAMPLE / "stream.jsonl"
    model = build_toy_model("qwen3", stream_texts(stream), tmp_path / "m", vocab_size=300)
    sink = QueueSink()
    stats = replay(stream, sink, speed=0, rule=prompt_rule(model, load_tokenizer))
    assert (stats.tasks, stats.bad, stats.drift_events) == (3000, 0, 1)
    [drift] = [m for m in sink.drain() if isinstance(m, DriftEvent)]
    assert (drift.at_seq, drift.prev_concepts["factures"], drift.concepts["factures"]) == (600, "crochets",
                                                                                           "parentheses")
    demos = read_demonstrations(stream, 400, model)
    assert len(demos) == 400
    factures = [d for p, _, d in demos if p.startswith("Facture")]
    assert 0.1 < sum(d.startswith("(") for d in factures) / len(factures) < 0.3  # one in five: the new format


def test_run_config_finetunes_on_the_demonstrations_and_measured_is_what_the_readme_quotes():
    from streamer.launch.run_config import RunConfig
    from streamer.wire.config import load_config

    cfg = load_config(RunConfig, EXAMPLE / "run.yaml")
    assert (cfg.finetune.rows, cfg.finetune.steps, cfg.launch.batch) == (400, 1000, 32)
    runs = json.loads((EXAMPLE / "measured.json").read_text())["runs"]
    readme = (EXAMPLE / "README.md").read_text()
    for run in runs.values():
        [rec] = [r for r in run["recoveries"] if r["family"] == "factures"]
        assert rec["status"] == "recovered"
        assert f"{rec['trajectories']} trajectories, {rec['learner_steps']} learner steps" in readme

"""examples/production-stream: the stream file is what its script writes, every row validates with the example's
user verifier enabled through its entry point, the verifier scores hand-written answers, the run config loads."""

from __future__ import annotations

import runpy
import shutil
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from simulator import verifiers
from simulator.replay import replay
from simulator.sinks import JsonlSink

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "production-stream"


@pytest.fixture
def example_verifier(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    [(name, value)] = project["entry-points"][verifiers.GROUP].items()
    point = EntryPoint(name=name, value=value, group=verifiers.GROUP)
    monkeypatch.setattr(verifiers.REGISTRY, "entry_points", lambda: [point])
    monkeypatch.setattr(verifiers.REGISTRY, "enabled", {})
    verifiers.enable([name])
    return name


def test_stream_file_is_what_make_stream_writes(tmp_path):
    shutil.copy(EXAMPLE / "make_stream.py", tmp_path / "make_stream.py")
    runpy.run_path(str(tmp_path / "make_stream.py"), run_name="__main__")
    assert (tmp_path / "stream.jsonl").read_bytes() == (EXAMPLE / "stream.jsonl").read_bytes()


def test_every_row_validates_with_the_user_verifier(tmp_path, example_verifier):
    stats = replay(EXAMPLE / "stream.jsonl", JsonlSink(tmp_path / "out.jsonl"), speed=0)
    assert (stats.tasks, stats.bad) == (640, 0)


@pytest.mark.parametrize("answer,params,want", [("(ab)", {}, 1.0), ("[ab]", {}, 0.5), ("[ab]", {"partial": 0.25}, 0.25),
                                                ("(abc)", {}, 0.0), ("ab", {}, 0.0)])
def test_wrapped_gives_half_credit_for_the_wrong_brackets(example_verifier, answer, params, want):
    assert verifiers.score(example_verifier, answer, "(ab)", params) == want


def test_run_config_enables_the_verifier_by_name():
    from streamer.launch.run_config import RunConfig
    from streamer.wire.config import load_config

    cfg = load_config(RunConfig, EXAMPLE / "run.yaml")
    assert cfg.agent.verifiers == ["wrapped"] and cfg.launch.scenario == "smoke"

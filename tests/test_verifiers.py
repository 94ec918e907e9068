"""Verifiers of recorded streams on answers written by hand, the open production row format, and replay of a
production stream with bad rows (JSONL, CSV, Parquet)."""

from __future__ import annotations

import csv
import json
from importlib.metadata import EntryPoint

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from simulator import verifiers
from simulator.env import make_env
from simulator.records import RowError, message_from_row
from simulator.replay import replay
from simulator.sinks import QueueSink


def half_credit(answer: str, reference: str, params: dict) -> float:  # a user verifier (entry point below)
    return 0.5 if reference in answer else 0.0


def broken(answer: str, reference: str, params: dict) -> float:
    raise RuntimeError("bug in a user verifier")


@pytest.mark.parametrize("name,answer,reference,params,want", [
    ("exact", " 42 ", "42", {}, 1.0),
    ("exact", "42.", "42", {}, 0.0),
    ("normalized_exact", "  The   Paris. ", "the paris", {}, 1.0),
    ("normalized_exact", "Paris, France", "paris", {}, 0.0),
    ("regex", "555-1234", "", {"pattern": r"\d{3}-\d{4}"}, 1.0),
    ("regex", "x555-1234", "", {"pattern": r"\d{3}-\d{4}"}, 0.0),
    ("regex", "YES", "yes|no", {"ignore_case": True}, 1.0),  # the reference is the pattern by default
    ("numeric", "The total is 1,234.5 dollars", "1234.5", {}, 1.0),
    ("numeric", "first 7, then 3.14", "3.1416", {"abs_tol": 0.01}, 1.0),  # the last number: |3.14-3.1416| <= 0.01
    ("numeric", "3.13", "3.1416", {"abs_tol": 0.01}, 0.0),  # |3.13-3.1416| = 0.0116
    ("numeric", "1000.9", "1000", {"rel_tol": 1e-3}, 1.0),  # tolerance 1.0
    ("numeric", "1001.1", "1000", {"rel_tol": 1e-3}, 0.0),
    ("numeric", "no number here", "5", {}, 0.0),
    ("numeric", "5", "five", {}, 0.0),  # a reference that is no number scores 0, it does not raise
    ("json_field", 'sure: {"a": {"b": [1, 2]}} done', "2", {"field": "a.b.1"}, 1.0),
    ("json_field", '{"status": "ok"}', "ok", {"field": "status"}, 1.0),  # reference compared as text
    ("json_field", '{"status": "ok"}', "ok", {"field": "code"}, 0.0),
    ("json_field", "no json", "ok", {"field": "status"}, 0.0),
    ("multiple_choice", "I think (B).", "B", {}, 1.0),
    ("multiple_choice", "A or B? Answer: C", "C", {}, 1.0),  # the last choice named
    ("multiple_choice", "Because it is", "B", {}, 0.0),  # letters inside words are not choices
    ("multiple_choice", "option 2", "2", {"choices": ["1", "2", "3"]}, 1.0),
])
def test_builtin_verifiers_on_hand_written_answers(name, answer, reference, params, want):
    verifiers.check(name, params)
    assert verifiers.score(name, answer, reference, params) == want


@pytest.mark.parametrize("name,params,message", [
    ("nosuch", {}, "verifier 'nosuch': unknown (known: exact, normalized_exact"),
    ("numeric", {"tol": 1}, "params: numeric takes ['abs_tol', 'rel_tol'], not ['tol']"),
    ("json_field", {}, "params: json_field needs ['field']"),
    ("regex", {"pattern": "("}, "params.pattern: not a regular expression"),
    ("exact", [], "params: expected an object, got list"),
])
def test_check_names_what_is_wrong(name, params, message):
    with pytest.raises(verifiers.VerifierError) as e:
        verifiers.check(name, params)
    assert message in str(e.value)


def test_user_verifiers_come_from_named_entry_points_only(monkeypatch):
    points = [EntryPoint(name="half", value="test_verifiers:half_credit", group=verifiers.GROUP),
              EntryPoint(name="broken", value="test_verifiers:broken", group=verifiers.GROUP)]
    monkeypatch.setattr(verifiers.REGISTRY, "entry_points", lambda: points)
    monkeypatch.setattr(verifiers.REGISTRY, "enabled", {})
    with pytest.raises(verifiers.VerifierError, match="verifier 'half': unknown"):
        verifiers.check("half", {})  # installed, but not enabled by the run's config
    with pytest.raises(verifiers.VerifierError, match=r"no entry point 'other' .* \(installed: broken, half\)"):
        verifiers.enable(["other"])
    verifiers.enable(["half", "broken", "exact"])
    verifiers.check("half", {"any": "params"})
    assert verifiers.score("half", "it is 42", "42", {}) == 0.5
    assert verifiers.score("broken", "x", "y", {}) == 0.0  # a raising verifier scores 0


def production_rows() -> list[dict]:
    return [
        {"task_id": "p1", "prompt": "what is 2+3?", "reference": "5", "verifier": "numeric",
         "tags": {"source": "support", "concept": "add"}, "time": 1.0},
        {"messages": [{"role": "user", "content": "capital of france?"}], "reference": "paris",
         "verifier": "normalized_exact", "tags": {"source": "qa", "concept": "geo"}, "time": 2.0},
        {"prompt": "pick one: a b c", "reference": "B", "verifier": "nosuch", "time": 3.0},  # bad: verifier
        {"prompt": "x", "messages": [], "reference": "1", "verifier": "exact"},  # bad: prompt and messages
        {"prompt": "use the tool", "reference": "1", "verifier": "exact", "tools": ["look"]},  # bad: tools
        {"prompt": "HELLO", "reference": "1", "verifier": "exact"},  # bad: outside the embedded model's alphabet
        {"prompt": "ok", "reference": "1", "verifier": "exact", "tags": {"n": 1}},  # bad: a tag that is no text
    ]


def test_production_row_becomes_a_task_tagged_by_source_and_concept():
    task = message_from_row(production_rows()[0])
    assert (task.task_id, task.family, task.concept, task.answer, task.created_at) == ("p1", "support", "add", "5", 1.0)
    assert task.spec == {"verifier": "numeric", "params": {}, "tags": {"source": "support", "concept": "add"}}
    chat = message_from_row(production_rows()[1])
    assert chat.prompt == "user: capital of france?" and chat.task_id.startswith("t-")
    assert message_from_row(production_rows()[1]).task_id == chat.task_id  # the id is a hash of the content
    env = make_env(chat)
    step = env.step("Paris.")
    assert (step.done, step.reward, step.success) == (True, 1.0, True)
    assert make_env(task).step("<call>look</call>").reward == 0.0  # markup is no answer
    with pytest.raises(RowError) as e:
        message_from_row({**production_rows()[0], "colour": "red"})
    assert e.value.field == "colour"


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    cols = ["task_id", "prompt", "messages", "reference", "verifier", "params", "tags", "time", "tools"]
    flat = [{c: (json.dumps(r[c]) if c in ("messages", "params", "tags", "tools") and c in r else r.get(c))
             for c in cols} for r in rows]
    if fmt == "csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows({k: "" if v is None else v for k, v in r.items()} for r in flat)
    else:
        pq.write_table(pa.Table.from_pylist(flat), path)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_replay_of_a_production_stream_skips_bad_rows_by_row_and_field(tmp_path, fmt):
    path = tmp_path / f"stream.{fmt}"
    _write(path, production_rows(), fmt)
    sink = QueueSink()
    stats = replay(path, sink, speed=0, skip_bad=True)
    tasks = []
    while (m := sink.queue.get()) is not None:
        tasks.append(m)
    assert [t.family for t in tasks] == ["support", "qa"]
    assert (stats.tasks, stats.bad, stats.bad_rows) == (2, 5, [3, 4, 5, 6, 7])
    rejects = [json.loads(line) for line in path.with_name(path.name + ".rejects.jsonl").read_text().splitlines()]
    assert [r["field"] for r in rejects] == ["verifier", "prompt", "tools", "prompt", "tags"]


def test_offline_agent_answers_a_production_stream_with_tagged_families(tmp_path, tiny_policy_dir):
    from streamer.agent.agent import main

    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps(r) + "\n" for r in production_rows()[:2]))
    out = tmp_path / "traj.jsonl"
    assert main(["--tasks", str(stream), "--out", str(out), "--model", str(tiny_policy_dir),
                 "--set", "max_new_tokens=4", "--weights-dir", str(tmp_path / "w")]) == 0
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["family"])
    assert [(r["task_id"], r["family"], r["concept"]) for r in rows][1] == ("p1", "support", "add")
    assert rows[0]["family"] == "qa" and all(r["reward"] in (0.0, 1.0) for r in rows)


def test_agent_refuses_a_user_verifier_that_is_not_installed(tmp_path, capsys):
    from streamer.agent.agent import main

    assert main(["--set", "verifiers=[mine]", "--weights-dir", str(tmp_path / "w")]) == 2
    assert "verifier 'mine': no entry point 'mine' in group sao_lab.verifiers" in capsys.readouterr().err

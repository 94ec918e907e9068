"""Record -> replay: order, content and scaled timing survive; bad rows are reported by row and field."""

from __future__ import annotations

import json
import random
import time

import pytest

from simulator.generator import generate
from simulator.replay import ReplayError, replay
from simulator.replay import main as replay_main
from simulator.run import main as simulate_main
from simulator.run import simulate
from simulator.scenario import Phase, Scenario, validate_scenario
from simulator.sinks import JsonlSink, QueueSink, file_sink
from streamer.wire.schema import DriftEvent, Task, to_dict


def _scenario(n: int, rate: float = 200.0) -> Scenario:
    mix = {"arith": 1.0, "string": 1.0, "format": 1.0, "tool": 1.0}
    first = Phase(name="a", duration_tasks=n // 2, families=mix,
                  concepts={"arith": "add10", "string": "reverse", "format": "brackets", "tool": "look/plain/0"})
    second = Phase(name="b", duration_tasks=n - n // 2, concepts={"string": "sort", "tool": "find/key/1"})
    scn = Scenario(name="r", rate=rate, arrival="poisson", phases=[first, second])
    validate_scenario(scn)
    return scn


def _record(path, n: int, rate: float = 200.0) -> list[Task | DriftEvent]:
    scn = _scenario(n, rate)
    simulate(scn, file_sink(path), seed=1, t0=1000.0)
    return list(generate(scn, seed=1, t0=1000.0))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_round_trip_preserves_order_and_content(tmp_path, fmt):
    src = tmp_path / f"rec.{fmt}"
    original = _record(src, 400)
    out = tmp_path / "out.jsonl"
    stats = replay(src, JsonlSink(out), speed=0)
    assert (stats.tasks, stats.drift_events, stats.bad) == (400, 1, 0)
    back = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k != "kind"} for r in back] == [to_dict(m) for m in original]


def test_replay_keeps_scaled_timing(tmp_path):
    src = tmp_path / "rec.jsonl"
    original = [m for m in _record(src, 120, rate=100.0) if isinstance(m, Task)]  # ~1.2 s of stream
    sink = QueueSink()
    replay(src, sink, speed=2.0, restamp=True)
    sent = [m for m in sink.drain() if isinstance(m, Task)]
    assert [t.task_id for t in sent] == [t.task_id for t in original]
    t0, s0 = original[0].created_at, sent[0].created_at
    for o, s in zip(original, sent):
        target = (o.created_at - t0) / 2.0  # speed 2 halves every gap
        assert s.created_at - s0 >= target - 0.003  # never early (timer slack)
    total_target = (original[-1].created_at - t0) / 2.0
    assert abs((sent[-1].created_at - s0) - total_target) < 0.25  # and not late overall on a busy machine


CORRUPTIONS = [
    lambda d: b"{not json",
    lambda d: json.dumps({**d, "prompt": 7}).encode(),
    lambda d: json.dumps({**d, "family": "chess"}).encode(),
    lambda d: json.dumps({k: v for k, v in d.items() if k != "answer"}).encode(),
    lambda d: json.dumps({**d, "prompt": "AGE OF X?"}).encode(),
    lambda d: json.dumps({**d, "spec": {}}).encode(),
    lambda d: json.dumps({**d, "v": 99}).encode(),
    lambda d: b"\xff\xfe\x00garbage",
]


def test_100k_rows_with_1pct_corrupt_skip_bad_reports_exactly_those(tmp_path):
    src = tmp_path / "big.jsonl"
    simulate(_scenario(100_000, rate=1000.0), file_sink(src), seed=2, t0=0.0)
    lines = src.read_bytes().splitlines()
    rng = random.Random(0)
    task_lines = [i for i, line in enumerate(lines) if b'"kind":"task"' in line]
    bad = sorted(rng.sample(task_lines, len(lines) // 100))
    for i in bad:
        lines[i] = CORRUPTIONS[i % len(CORRUPTIONS)](json.loads(lines[i]))
    src.write_bytes(b"\n".join(lines) + b"\n")
    out, rej = tmp_path / "out.jsonl", tmp_path / "rejects.jsonl"
    assert replay_main([str(src), "--speed", "0", "--out", str(out), "--skip-bad", "--rejects", str(rej)]) == 0
    rejects = [json.loads(line) for line in rej.read_text().splitlines()]
    assert [r["row"] for r in rejects] == [i + 1 for i in bad]  # rows are 1-based line numbers
    assert len(out.read_text().splitlines()) == len(lines) - len(bad)
    assert {r["field"] for r in rejects} >= {"<line>", "prompt", "family", "answer", "spec.tool"}


def test_bad_row_without_skip_stops_with_row_and_field(tmp_path, capsys):
    src = tmp_path / "rec.jsonl"
    _record(src, 20)
    lines = src.read_text().splitlines()
    row = json.loads(lines[6])
    row["seq"] = "seven"
    lines[6] = json.dumps(row)
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReplayError, match=r"rec.jsonl: row 7: field 'seq'"):
        replay(src, QueueSink(), speed=0)
    assert replay_main([str(src), "--speed", "0", "--out", str(tmp_path / "o.jsonl")]) == 1
    assert "row 7: field 'seq'" in capsys.readouterr().err


def test_csv_bad_cell_names_row_and_column(tmp_path):
    src = tmp_path / "rec.csv"
    _record(src, 10)
    lines = src.read_text().splitlines()
    lines[3] = lines[3].replace(",task,", ",task,", 1)
    head, cells = lines[0].split(","), lines[3].split(",")
    cells[head.index("phase")] = "x"
    lines[3] = ",".join(cells)
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReplayError, match=r"row 3: field 'phase'"):
        replay(src, QueueSink(), speed=0)


def test_bad_times_and_a_malformed_csv_row_are_rejected_not_slept_on(tmp_path):
    """A row 1e9 s ahead slept ~116 days at --speed 100, 1e300 raised OverflowError, a drift row at a negative
    time was accepted, a CSV row with an extra cell raised a pandas traceback even with --skip-bad (issue 14)."""
    src = tmp_path / "rec.jsonl"
    _record(src, 20)
    lines = src.read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    drift = next(i for i, r in enumerate(rows) if r["kind"] == "drift")
    tasks = [i for i, r in enumerate(rows) if r["kind"] == "task"]
    rows[tasks[3]]["created_at"] += 1e9
    rows[tasks[5]]["created_at"] = 1e300
    rows[drift]["time"] = -5.0
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rej = tmp_path / "rej.jsonl"
    t0 = time.monotonic()
    stats = replay(src, QueueSink(), speed=100.0, skip_bad=True, rejects=rej)
    assert time.monotonic() - t0 < 5.0 and (stats.tasks, stats.bad, stats.drift_events) == (18, 3, 0)
    got = {r["row"]: (r["field"], r["error"]) for r in map(json.loads, rej.read_text().splitlines())}
    assert got[tasks[3] + 1][0] == "created_at" and "s after the previous row's time (more than --max-gap 3600 s)" \
        in got[tasks[3] + 1][1]
    assert got[tasks[5] + 1][0] == "created_at" and \
        got[drift + 1] == ("time", "field 'time': not a finite time >= 0: -5.0")
    with pytest.raises(ReplayError, match=rf"row {tasks[3] + 1}: field 'created_at'"):
        replay(src, QueueSink(), speed=100.0)

    csv_src = tmp_path / "rec.csv"
    _record(csv_src, 10)
    lines = csv_src.read_text().splitlines()
    lines[4] += ",surplus"
    lines[6] = lines[6].split(",", 1)[0]
    csv_src.write_text("\n".join(lines) + "\n")
    stats = replay(csv_src, QueueSink(), speed=0, skip_bad=True, rejects=rej)
    assert stats.bad_rows == [4, 6] and stats.tasks + stats.drift_events == 9
    got = [json.loads(x) for x in rej.read_text().splitlines()]
    assert [r["field"] for r in got] == ["<row>", "<row>"]
    assert "1 more cell(s) than the header's columns" in got[0]["error"] and "fewer cells" in got[1]["error"]


def test_simulate_command_writes_the_file(tmp_path, capsys):
    out = tmp_path / "tasks.jsonl"
    assert simulate_main(["--scenario", "default", "--out", str(out), "--limit", "50", "--seed", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tasks"] == 50 and len(out.read_text().splitlines()) == 50


def _row(i: int, source: str, concept: str) -> dict:
    return {"task_id": f"p{i}", "prompt": f"f:{'ab'[i % 2]}=", "reference": "[a]", "verifier": "exact",
            "tags": {"source": source, "concept": concept}, "time": float(i)}


def test_a_tag_change_is_a_drift_and_nearby_changes_join_it(tmp_path):
    # forms x -> y at row 3 opens an event; tickets u -> v at row 5 is inside its 4-row window: the same event.
    # forms y -> z at row 12 (forms already changed): a second event; tickets v -> w at row 18, past the second
    # event's window: a third.
    plan = [("forms", "x"), ("tickets", "u"), ("forms", "x"), ("forms", "y"), ("tickets", "u"), ("tickets", "v"),
            *[("forms", "y"), ("tickets", "v")] * 3, ("forms", "z"), ("tickets", "v"), *[("forms", "z")] * 4,
            ("tickets", "w"), ("forms", "z")]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(_row(i, s, c)) + "\n" for i, (s, c) in enumerate(plan)))
    sink = QueueSink()
    stats = replay(src, sink, speed=0.0, tag_window=4)
    msgs = sink.drain()
    assert stats.tasks == len(plan) == 20 and stats.drift_events == 3
    kinds = ["drift" if isinstance(m, DriftEvent) else m.task_id for m in msgs]
    assert kinds == ["p0", "p1", "p2", "drift", *[f"p{i}" for i in range(3, 12)], "drift",
                     *[f"p{i}" for i in range(12, 18)], "drift", "p18", "p19"]
    first, second, third = [m for m in msgs if isinstance(m, DriftEvent)]
    assert (first.phase, first.prev_phase, first.at_seq, first.time) == (1, 0, 3, 3.0)
    assert first.prev_concepts == {"forms": "x", "tickets": "u"}
    assert first.concepts == {"forms": "y", "tickets": "v"} and first.name == "forms:y+tickets:v"
    assert (second.phase, second.at_seq, second.concepts, second.prev_concepts) == (
        2, 12, {"forms": "z", "tickets": "v"}, {"forms": "y", "tickets": "v"})
    assert (third.phase, third.at_seq, third.concepts) == (3, 18, {"forms": "z", "tickets": "w"})
    tasks = [m for m in msgs if isinstance(m, Task)]
    assert [t.phase for t in tasks] == [0] * 3 + [1] * 9 + [2] * 6 + [3] * 2
    assert [t.seq for t in tasks] == list(range(len(plan)))
    assert replay(src, QueueSink(), speed=0.0, limit=5).tasks == 5  # held rows count against the limit

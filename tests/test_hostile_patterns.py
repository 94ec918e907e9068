"""Hostile verifier input (issue 50 item 2): a row's regex cannot make scoring take super-linear time, a pattern RE2
refuses is refused at validation naming the row and field, and a user verifier that never ends is killed past
`verifier_timeout_s` in its worker process: the task scores 0 and is dead-lettered, the agent goes on."""

from __future__ import annotations

import json
import threading
import time
from importlib.metadata import EntryPoint

import pytest

from simulator import verifiers
from simulator.env import make_env
from simulator.records import RowError, message_from_row
from simulator.replay import replay
from simulator.sinks import QueueSink

HOSTILE = "(.|.)*Q"  # Python's re: time doubles per answer character (0.4 s at 22, hours at 40)


def loop_forever(answer: str, reference: str, params: dict) -> float:  # a user verifier that never ends
    while True:
        pass


def contains(answer: str, reference: str, params: dict) -> float:  # a well-behaved user verifier
    return float(reference in answer)


def exits(answer: str, reference: str, params: dict) -> float:  # a user verifier that ends its process
    import os

    os._exit(3)


@pytest.fixture
def user_verifiers(monkeypatch):
    """`loop`, `contains` and `exits` enabled through entry points, as an installed package publishes them."""
    points = [EntryPoint(name=n, value=f"test_hostile_patterns:{f}", group=verifiers.GROUP)
              for n, f in (("loop", "loop_forever"), ("contains", "contains"), ("exits", "exits"))]
    monkeypatch.setattr(verifiers.REGISTRY, "entry_points", lambda: points)
    monkeypatch.setattr(verifiers.REGISTRY, "enabled", {})
    monkeypatch.setattr(verifiers, "TIMEOUT_S", 0.5)
    verifiers.enable(["loop", "contains", "exits"])
    yield
    if verifiers._worker is not None:
        verifiers._worker.close()


def row(**kw) -> dict:
    return {"task_id": "r1", "prompt": "f:ab=", "reference": "[ab]", "verifier": "regex", "time": 0.0, **kw}


@pytest.mark.parametrize("answer,reference,params,want", [
    ("555-1234", "", {"pattern": r"\d{3}-\d{4}"}, 1.0),
    (" 555-1234\n", "", {"pattern": r"\d{3}-\d{4}"}, 1.0),  # the answer is stripped
    ("x555-1234", "", {"pattern": r"\d{3}-\d{4}"}, 0.0),  # a full match, not a search
    ("555-12345", "", {"pattern": r"\d{3}-\d{4}"}, 0.0),
    ("YES", "yes|no", {"ignore_case": True}, 1.0),  # the reference is the pattern by default
    ("YES", "yes|no", {}, 0.0),  # case counts unless ignore_case
    ("no", "yes|no", {}, 1.0),
    ("[ab]", r"\[ab\]", {}, 1.0),
    ("colour", "colou?r", {}, 1.0),
    ("color", "colou?r", {}, 1.0),
    ("colouur", "colou?r", {}, 0.0),
    ("été", "é.é", {}, 1.0),  # characters, not bytes: . matches é
])
def test_normal_patterns_score_as_written_by_hand(answer, reference, params, want):
    verifiers.check("regex", params, reference)
    assert verifiers.score("regex", answer, reference, params) == want


@pytest.mark.parametrize("params,reference", [({"pattern": HOSTILE}, ""), ({}, HOSTILE)])
def test_the_hostile_pattern_scores_0_in_linear_time(params, reference):
    """The issue's row (its reference is the pattern, no params.pattern) and the same pattern as params.pattern."""
    verifiers.check("regex", params, reference)  # RE2 matches it in linear time: nothing to refuse
    for n in (22, 40, 4096):
        t0 = time.perf_counter()
        assert verifiers.score("regex", "a" * n, reference, params) == 0.0
        assert time.perf_counter() - t0 < 1.0  # a generous guard: Python's re takes hours at n = 40
    assert verifiers.score("regex", "a" * 39 + "Q", reference, params) == 1.0  # it still matches what it should


def test_the_hostile_row_is_scored_0_by_the_environment():
    task = message_from_row(row(reference=HOSTILE))
    t0 = time.perf_counter()
    step = make_env(task).step("a" * 40)
    assert (step.done, step.reward) == (True, 0.0) and time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("bad,field,what", [
    (row(reference=r"(a)\1"), "reference", "invalid escape sequence"),  # a backreference, in the reference
    (row(params={"pattern": "(?=a)a"}), "params.pattern", "invalid perl operator"),  # a lookahead
    (row(params={"pattern": "(?<!a)b"}), "params.pattern", "invalid perl operator"),  # a lookbehind
    (row(params={"pattern": "a{1001}"}), "params.pattern", "invalid repetition size"),
    (row(params={"pattern": "((a{100}){100}){100}"}), "params.pattern", "invalid repetition size"),
    (row(params={"pattern": "[\\p{L}]{1000}"}), "params.pattern", "pattern too large"),  # over RE2_MAX_MEM
    (row(params={"pattern": "a" * 1001}), "params.pattern", "1001 characters (at most 1000)"),
    (row(reference="a" * 1001), "reference", "1001 characters (at most 1000)"),
    (row(params={"pattern": 5}), "params.pattern", "expected text, got int"),
    (row(verifier="multiple_choice", reference="A", params={"choices": [f"c{i}" for i in range(65)]}),
     "params.choices", "1 to 64 choices"),
])
def test_a_pattern_re2_refuses_is_refused_at_validation_naming_the_field(bad, field, what):
    with pytest.raises(RowError) as e:
        message_from_row(bad)
    assert e.value.field == field and what in str(e.value)


def test_replay_sets_refused_patterns_aside_by_row_and_field(tmp_path):
    rows = [row(task_id="ok1"), row(task_id="bad1", reference=r"(\w)\1"), row(task_id="hostile", reference=HOSTILE),
            row(task_id="bad2", params={"pattern": "(?!x)y"}), row(task_id="ok2", verifier="exact")]
    path = tmp_path / "stream.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sink = QueueSink()
    stats = replay(path, sink, speed=0, skip_bad=True)
    assert (stats.tasks, stats.bad, stats.bad_rows) == (3, 2, [2, 4])
    rejects = [json.loads(line) for line in (tmp_path / "stream.jsonl.rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["field"]) for r in rejects] == [(2, "reference"), (4, "params.pattern")]
    assert "backreferences and lookarounds are refused" in rejects[0]["error"]


def test_a_task_message_with_a_refused_pattern_is_refused_by_the_environment():
    """A task that reaches an agent without the replay's validation (a project message on the topic): the agent's
    environment refuses it (a ValueError: the agent dead-letters it) instead of scoring it."""
    from streamer.wire.schema import Task

    task = Task(task_id="t", family="qa", concept="c", prompt="f:ab=", answer=r"(a)\1",
                spec={"verifier": "regex", "params": {}})
    with pytest.raises(ValueError, match=r"task t .*reference: not a regular expression RE2"):
        make_env(task)


def test_a_user_verifier_that_never_ends_is_killed_past_the_limit(user_verifiers):
    ticks = []
    stop = threading.Event()

    def heartbeat():  # stands for the consumer's heartbeat thread: it must keep running while the score waits
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    assert verifiers.score("contains", "xx42xx", "42", {}) == 1.0  # starts the worker
    beat = threading.Thread(target=heartbeat)
    beat.start()
    t0 = time.monotonic()
    with pytest.raises(verifiers.VerifierTimeout, match=r"verifier 'loop' ran past its limit of 0.5 s"):
        verifiers.score("loop", "anything", "ref", {})
    waited = time.monotonic() - t0
    stop.set()
    beat.join()
    assert 0.5 <= waited < 2.0
    assert sum(t0 <= t <= t0 + waited for t in ticks) >= 20  # ~50 ticks: the GIL was free during the wait
    assert verifiers._worker.restarts == 1
    assert verifiers.score("contains", "xx42xx", "42", {}) == 1.0  # a fresh worker answers the next task
    assert verifiers.score("contains", "xx", "42", {}) == 0.0


def test_a_user_verifier_that_ends_its_process_scores_0_and_the_next_call_goes_on(user_verifiers):
    assert verifiers.score("exits", "a", "b", {}) == 0.0
    assert verifiers.score("contains", "b", "b", {}) == 1.0


ORPHAN = """
import sys
sys.path.insert(0, sys.argv[1])
from simulator.verifier_worker import Worker
w = Worker({"contains": "test_hostile_patterns:contains", "loop": "test_hostile_patterns:loop_forever"}, 600)
w.score("contains", "a", "a", {})
print(w._proc.pid, flush=True)
w.score("loop", "a", "a", {})
"""


def test_a_killed_caller_leaves_no_worker_spinning(tmp_path):
    """SIGKILL of the agent while its user verifier loops: the worker notices it lost its parent and exits."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    caller = subprocess.Popen([sys.executable, "-c", ORPHAN, str(Path(__file__).parent)], stdout=subprocess.PIPE,
                              text=True)
    worker_pid = int(caller.stdout.readline())
    time.sleep(0.5)  # the worker is in the loop now
    assert Path(f"/proc/{worker_pid}").exists()
    os.kill(caller.pid, signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{worker_pid}/stat").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{worker_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":  # exited, waiting for init to reap it
            break
        time.sleep(0.1)
    gone = not Path(f"/proc/{worker_pid}/stat").exists() or state == "Z"
    assert gone, f"worker {worker_pid} still running after its caller was killed"


def test_a_timed_out_task_is_dead_lettered_and_the_agent_goes_on(user_verifiers, tiny_policy_dir):
    from learner.engines import make_engine
    from streamer.agent.agent import build_agent
    from streamer.transport.memory_bus import MemoryBus
    from streamer.transport.sinks import KafkaTaskSink
    from streamer.wire.schema import DeadLetter, Task, Trajectory, decode
    from streamer.wire.settings import AgentSettings
    from streamer.wire.topics import partitions_by_topic

    rows = [row(task_id=f"ok{i}", verifier="contains", reference="a") for i in range(3)]
    rows.insert(1, row(task_id="loops", verifier="loop"))
    tasks = [message_from_row(r) for r in rows]
    bus = MemoryBus()
    bus.create_topics(partitions_by_topic("h"))
    sink = KafkaTaskSink(None, "h", producer=bus.producer())
    for t in tasks:
        sink.write(t)
    s = AgentSettings(run="h", max_new_tokens=4, idle_exit_s=0.01, verifier_timeout_s=0.5)
    engine = make_engine("torch", tiny_policy_dir)
    t0 = time.monotonic()
    stats = build_agent(s, bus, engine, engine.tokenizer).run()
    assert time.monotonic() - t0 < 20
    assert (stats.tasks, stats.failed) == (3, 1)
    trajs = [decode(v, Trajectory) for part in bus.logs["h.trajectories"] for _, v in part]
    assert sorted(t.task_id for t in trajs) == ["ok0", "ok1", "ok2"]
    [letter] = [decode(v, DeadLetter) for part in bus.logs["h.dlq"] for _, v in part]
    assert letter.key == b"loops" and decode(letter.value, Task).task_id == "loops"
    assert letter.reason == ("rollout failed: VerifierTimeout: task loops: verifier 'loop' ran past its limit of "
                             "0.5 s (agent.verifier_timeout_s); scored 0, task dead-lettered")
    assert sum(bus.committed["h.agents"].values()) == 4  # the looping task is committed too: no agent retries it


def install_looping_verifier(site) -> None:
    """A package on PYTHONPATH whose entry point `loop` (group sao_lab.verifiers) never returns, as a user would
    install one (`pip install`): the `sao up` roles find it by its metadata, as they find any user verifier."""
    site.mkdir()
    (site / "loopy_verifiers.py").write_text("def loop(answer, reference, params):\n    while True:\n        pass\n")
    info = site / "loopy_verifiers-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: loopy-verifiers\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sao_lab.verifiers]\nloop = loopy_verifiers:loop\n")


@pytest.mark.slow
@pytest.mark.kafka
def test_up_replays_hostile_rows_and_finishes_with_every_task_accounted_for(tmp_path):
    """`sao up --stream FILE` on a stream with the issue's hostile row, two patterns RE2 refuses and a row whose user
    verifier never ends: the run ends by itself; the refused rows are set aside by row and field, the looping row is
    dead-lettered by the agent with its reason, and every other task (the hostile one included, scored 0) is
    answered once."""
    import os
    import subprocess
    import sys

    from test_up_stream import stream_rows

    from streamer.runs.readers import read_summary, read_trajectories

    rows = [r for r in stream_rows() if r["task_id"] != "bad"][:96]
    rows.insert(5, row(task_id="hostile", prompt="f:aaaa=", reference=HOSTILE, time=0.26))  # the issue's row
    rows.insert(20, row(task_id="backref", params={"pattern": r"(a)\1"}, time=0.96))
    rows.insert(40, row(task_id="lookahead", reference="(?=a)a", time=1.96))
    rows.insert(60, row(task_id="loops", verifier="loop", time=2.96))
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(json.dumps({**r, "tags": {"source": "fmt", "concept": "brackets"}}) + "\n"
                              for r in rows))
    install_looping_verifier(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--run", "h", "--runs-dir", str(tmp_path / "runs"),
           "--scenario", "smoke", "--stream", str(stream), "--no-dashboard", "--no-eval", "--agents", "1",
           "--cores", "2", "--batch", "32", "--set", "pretrain.steps=40", "--set", "pretrain.eval_every=0",
           "--set", "agent.verifiers=[loop]", "--set", "agent.verifier_timeout_s=1", "--max-seconds", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    run_dir = tmp_path / "runs" / "h"
    assert read_summary(run_dir)["stopped"] == "scenario finished: every task answered or dead-lettered (1)"
    rejects = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["field"]) for r in rejects] == [(21, "params.pattern"), (41, "reference")]
    trajs = read_trajectories(run_dir)
    answered = {r["task_id"] for r in rows} - {"backref", "lookahead", "loops"}
    assert len(trajs) == trajs["task_id"].nunique() == len(answered) == 97
    assert set(trajs["task_id"]) == answered
    assert trajs[trajs["task_id"] == "hostile"]["reward"].tolist() == [0.0]
    agent_log = (run_dir / "logs" / "agent-0.log").read_text()
    assert ("task loops rollout failed: VerifierTimeout: task loops: verifier 'loop' ran past its limit of 1 s "
            "(agent.verifier_timeout_s); scored 0, task dead-lettered -> DLQ") in agent_log
    assert json.loads((run_dir / "agent-0.json").read_text())["failed"] == 1

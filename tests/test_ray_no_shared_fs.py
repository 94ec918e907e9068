"""`sao up --ray-address` with agents on a node that shares no filesystem with the driver: the run's config.yaml
travels by value (each actor writes its node's copy), agents start from the learner's weight server, the learner is
pinned to the driver's node and advertised at its IP. The cluster is `ray.cluster_utils.Cluster` on this machine: the
head (the driver's node) and a second node at 127.0.0.2 with the custom resource `agents` and its own runs directory
(`SAO_NODE_RUNS_DIR`), so a file its actors read from the driver's runs directory would not be found there."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml
from role_stub import role_script

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def agents_node(tmp_path_factory):
    from ray.cluster_utils import Cluster

    node_runs = tmp_path_factory.mktemp("node2-runs")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2, resources={"agents": 2}, node_ip_address="127.0.0.2",
                     env_vars={"SAO_NODE_RUNS_DIR": str(node_runs)})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster, node_runs
    finally:
        ray.shutdown()
        cluster.shutdown()


# a role: records its argv and the config.yaml it was given (--config), idles to SIGINT
ROLE = role_script(r"""
argv = sys.argv[1:]
config = argv[argv.index("--config") + 1]
rec = {"argv": argv, "config": config, "text": open(config).read()}
""")


def run_config(tmp_path: Path, address: str, *overrides: str, transport: str = "http"):
    from streamer.launch.run_config import bind_init, load_run_config

    init = tmp_path / "init"  # the warm start: on the driver's node only
    init.mkdir(exist_ok=True)
    cfg = load_run_config(None, ["ray.agent.num_cpus=0.5", "ray.learner.num_cpus=0.5",
                                 "ray.agent.resources={agents: 1}",
                                 *overrides],
                          {"run": "r", "runs_dir": str(tmp_path / "runs"), "ray_address": address, "agents": 2,
                           "cores": 2, "batch": 8, "weights_transport": transport})
    bind_init(cfg, init)
    return cfg


@pytest.mark.slow  # ~12 s on 2 busy cores (8 of them the 2-node cluster's start); 3 stub roles, no Kafka
def test_config_by_value_agents_from_the_weight_server_learner_on_the_drivers_node(agents_node, tmp_path):
    from streamer.launch.ray_launch import RAY_ROLES, RaySupervisor
    from streamer.launch.ray_nodes import driver_ip, learner_on_driver, run_needs
    from streamer.launch.run_config import advertise_on
    from streamer.launch.up import roles
    from streamer.wire.config import write_yaml

    cluster, node_runs = agents_node
    cfg = run_config(tmp_path, cluster.address)
    io, port = cfg.learner.io, cfg.learner.io.weights_bind.rpartition(":")[2]
    assert io.weights_bind == f"0.0.0.0:{port}"  # on a cluster the server listens on every interface
    run_dir = Path(cfg.launch.runs_dir) / "r"
    config_file = run_dir / "config.yaml"
    config_file.parent.mkdir(parents=True)
    write_yaml(cfg, config_file)
    out = tmp_path / "out"
    out.mkdir()
    sup = RaySupervisor(run_dir / "logs", {"OUT": str(out), "SAO_RUN": "r"}, cfg.ray, "http")
    sup.entry = ["-c", ROLE]
    assert learner_on_driver(cfg.ray, "http") and advertise_on(cfg, driver_ip())
    write_yaml(cfg, config_file)
    sup.ship(run_dir, {"config.yaml": config_file.read_text()})
    records = lambda: [json.loads(f.read_text()) for f in out.glob("*.json")]  # noqa: E731
    try:
        started = [sup.start(r) for r in roles(cfg, config_file, run_dir, "kafka:9092") if r.argv[0] in RAY_ROLES]
        deadline = time.monotonic() + 90
        while len(records()) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(records()) == 3, [sup.tail(r) for r in started]
        places = {r.name: ray.get(r.proc.actors[0].where.remote()) for r in started}
        driver = ray.get_runtime_context().get_node_id()
        assert places["learner"]["node_id"] == driver and places["learner"]["ip"] == driver_ip()  # pinned
        assert {places[f"agent-{i}"]["ip"] for i in range(2)} == {"127.0.0.2"}  # the agents' node
        text = config_file.read_text()
        by_role = {r["argv"][0]: r for r in records()}
        learner = by_role["learn"]
        assert learner["config"] == str(config_file) and learner["text"] == text  # the driver's node: same path
        agents = [r for r in records() if r["argv"][0] == "agent"]
        for rec in agents:  # their node's own copy, identical to the driver's
            assert rec["config"] == str(node_runs / "r" / "config.yaml") and rec["text"] == text
            status = rec["argv"][rec["argv"].index("--status-file") + 1]
            assert status.startswith(str(node_runs / "r") + "/")
            assert f"model_cache={node_runs / 'r' / 'agent-'}" in " ".join(rec["argv"])  # a cache each, on its node
            agent = yaml.safe_load(rec["text"])["agent"]
            assert agent["model"] == f"http://{places['learner']['ip']}:{port}/latest"  # from the weight server
            assert agent["weights_url"] == f"http://{places['learner']['ip']}:{port}"
        assert (node_runs / "r" / "logs" / socket.gethostname() / "agent-0.log").is_file()
        assert yaml.safe_load(text)["learner"]["io"]["init"] == str(tmp_path / "init")  # read on the driver's node
        needs = {n.setting for n in run_needs(cfg)}
        assert "agent.model" not in needs and not any("config.yaml" in n for n in needs)
        sup.check_shared(run_needs(cfg))  # nothing the agents' node must share: passes
    finally:
        sup.stop_all(timeout=10)


def test_a_users_advertised_address_wins_and_directory_keeps_the_model_path(tmp_path):
    from streamer.launch.ray_nodes import learner_on_driver
    from streamer.launch.run_config import advertise_on

    cfg = run_config(tmp_path, "ray://head:10001", "launch.weights_advertised=learner.example:8765",
                     "launch.weights_bind=0.0.0.0:8765")
    assert cfg.agent.model == "http://learner.example:8765/latest"
    assert not advertise_on(cfg, "10.0.0.7") and cfg.agent.weights_url == "http://learner.example:8765"
    cfg = run_config(tmp_path, "ray://head:10001", transport="directory")
    assert cfg.agent.model == str(tmp_path / "init") and not learner_on_driver(cfg.ray, "directory")
    cfg = run_config(tmp_path, "")  # a local Ray instance: loopback, as before
    assert cfg.learner.io.weights_bind.startswith("127.0.0.1:") and cfg.agent.model == str(tmp_path / "init")



@pytest.mark.slow  # 50-72 s on 2 busy cores (the warm start, the embedded broker, 192 tasks)
@pytest.mark.kafka
def test_up_on_two_nodes_with_agents_on_a_node_of_their_own_runs_dir(agents_node, tmp_path):
    """`sao up --ray-address <cluster> --weights-transport http` on the smoke scenario (2 agents on the second node,
    192 tasks, a 30-step warm start): every task answered; the agents ran on their node's copy of config.yaml, kept
    their status and logs in its runs directory (none in the driver's), and loaded versions from the learner's
    server at the driver node's IP."""
    import subprocess

    cluster, node_runs = agents_node
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--run", "e", "--runs-dir", str(runs), "--scenario",
           "smoke", "--no-dashboard", "--no-eval", "--agents", "2", "--cores", "2", "--batch", "32", "--limit", "192",
           "--set", "pretrain.steps=30", "--set", "pretrain.eval_every=0", "--weights-transport", "http",
           "--ray-address", cluster.address, "--set", "ray.agent.num_cpus=0.5", "--set", "ray.learner.num_cpus=1",
           "--set", "ray.agent.resources={agents: 1}", "--max-seconds", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    run_dir, node_dir = runs / "e", node_runs / "e"
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "scenario finished: every task answered"
    text = (run_dir / "config.yaml").read_text()
    assert (node_dir / "config.yaml").read_text() == text  # the agents' node's copy
    agent = yaml.safe_load(text)["agent"]
    url = agent["weights_url"]
    assert agent["model"] == f"{url}/latest" and not url.startswith(f"http://{socket.gethostname()}:")
    assert not list(run_dir.glob("agent-*.json"))  # nothing of the agents' in the driver's runs directory
    statuses = [json.loads((node_dir / f"agent-{i}.json").read_text()) for i in range(2)]
    assert sum(s["tasks"] for s in statuses) == 192 and all(s["refused"] == {} for s in statuses)
    for i in range(2):
        log = (node_dir / "logs" / socket.gethostname() / f"agent-{i}.log").read_text()
        assert log.count(f"loaded from {url} ") >= 1, log[-2000:]

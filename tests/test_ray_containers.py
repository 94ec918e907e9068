"""`sao up --ray-address` on a Ray cluster of containers with no shared volume (issue 46: the Ray half of "agents on
other hosts, following docs/scale.md word for word").

`docker/compose.ray.yml` on a bridge network: the broker (the embedded one), the Ray head and a Ray worker, each
with its own filesystem. Inside the head the test runs docs/scale.md's Ray command, read from the page itself, with
the values a user substitutes (KAFKA -> broker, 2 agents) and flags that keep the run short (the smoke scenario,
192 tasks). The head offers Ray only the learner's CPUs, so with `ray.agent_strategy=SPREAD` the agents land on the
worker. It checks: `sao up` exits 0 with every task answered; both agents ran on the worker (their status files and
logs are there, their trajectories carry its hostname), each loaded at least MIN_VERSIONS versions from the
weight server at the head's address with the sha256 the learner announced (and the versions differ); no trajectory
lost or trained twice; the worker holds none of the head's run directory (no weights, checkpoints, warm start or
tables: only its agents' copy of config.yaml, their status, logs and model caches). Figures go to
docs/results/multihost/ray.json. Skipped with its reason when no Docker daemon can be started; SAO_REQUIRE_DOCKER=1
(set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from test_compose_up import require_docker
from test_multihost import Hosts, assert_trained_once, build_image, loaded_versions

from streamer.runs.readers import read_learner, read_trajectories

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "docs" / "results" / "multihost" / "ray.json"
COMPOSE = "docker/compose.ray.yml"
PROJECT = "sao-ray-e2e"  # its own compose project: a user's stack of the same file is left alone
AGENTS, BATCH, TASKS = 2, 32, 192
MIN_VERSIONS = 3  # tests/test_multihost.py's loaded_versions asserts this many per agent
# Kept short: 192 tasks of the smoke scenario, a warm start of 120 steps (its rewards are not all 0, so training
# moves the weights and the versions differ), tests/test_up_e2e.py's tuned learner settings.
SHORT = ("--scenario smoke --limit 192 --batch 32 --cores 2 --no-dashboard --no-eval --max-seconds 400 "
         "--set pretrain.steps=120 --set pretrain.eval_every=0 --set learner.optim.updates_per_batch=2 "
         "--set learner.value.warmup_steps=2 --set learner.optim.lr=1e-4")


def docs_ray_command() -> list[str]:
    """docs/scale.md's `sao up --ray-address` command (section Ray), KAFKA -> broker, 2 agents."""
    page = (ROOT / "docs" / "scale.md").read_text()
    block = re.search(r"\n## Ray\n.*?```bash\n(.*?)```", page, re.S).group(1)
    line = block.replace("\\\n", " ")
    assert line.count("sao up --ray-address auto") == 1, block
    words = line.split()
    assert "KAFKA:9092" in words and "--agents" in words, line
    words = ["broker:9092" if w == "KAFKA:9092" else w for w in words]
    words[words.index("--agents") + 1] = str(AGENTS)
    return words


@pytest.fixture(scope="module")
def ray_image() -> dict:
    """The project image (tests/test_multihost.py's build) plus the ray extra (docker/build-extras.sh ray), timed."""
    require_docker()
    t0 = time.monotonic()
    note = build_image()
    t1 = time.monotonic()
    built = subprocess.run([str(ROOT / "docker" / "build-extras.sh"), "ray"], cwd=ROOT, capture_output=True,
                           text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return {"build": note, "build_s": round(t1 - t0, 1), "ray_layer_s": round(time.monotonic() - t1, 1)}


def ray_nodes(h: Hosts) -> int:
    """Ray nodes alive, as the head sees them (0 until its GCS answers)."""
    out = h.exec("head", "python", "-c", "import ray; ray.init('auto', log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes()))", check=False).stdout.strip().splitlines()
    return int(out[-1]) if out and out[-1].isdigit() else 0


def ip_of(h: Hosts, service: str) -> str:
    return subprocess.run(["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                           h.container(service)], capture_output=True, text=True, check=True).stdout.strip()


def test_sao_up_on_a_ray_cluster_of_containers_agents_on_the_worker(ray_image, tmp_path):
    h = Hosts(PROJECT, [COMPOSE], "ray")
    h.run("down", "-v", "--remove-orphans", check=False)
    try:
        run_on_ray(h, tmp_path, ray_image)
    finally:
        h.down()


def run_on_ray(h: Hosts, tmp_path: Path, image: dict) -> None:
    h.run("up", "-d", "broker", "head", "worker")
    for service in ("broker", "head", "worker"):  # nothing mounted: each has its own filesystem
        assert h.mounts(service) == [], f"{service} has mounts: {h.mounts(service)}"
    driver = subprocess.run(["docker", "network", "inspect", "-f", "{{.Driver}}", f"{PROJECT}_hosts"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert driver == "bridge"
    h.wait("the worker to join the head", lambda: h.alive("head") and h.alive("worker") and ray_nodes(h) == 2,
           timeout=180, every=3)
    h.mark("cluster_s")

    # docs/scale.md's command, in the head (as `docker compose exec head ...` would run it)
    cmd = docs_ray_command() + SHORT.split()
    t0 = time.monotonic()
    up = subprocess.run(["docker", "exec", h.container("head"), *cmd], capture_output=True, text=True, timeout=600)
    up_s = time.monotonic() - t0
    h.mark("up_done_s")
    assert up.returncode == 0, f"{' '.join(cmd)}\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
    run = re.search(r"summary: /app/runs/(\S+)/summary\.json", up.stdout).group(1)
    remote = f"/app/runs/{run}"

    # Where the agents ran: the worker (status files, logs under its hostname, a model cache each); nothing else of
    # the run is there.
    on_worker = set(h.sh("worker", f"ls {remote}").split())
    agents = [f"agent-{i}" for i in range(AGENTS)]
    assert on_worker == {"config.yaml", "logs", *(f"{a}.json" for a in agents), *(f"{a}-model" for a in agents)}
    assert h.sh("worker", f"ls {remote}/logs").split() == ["worker"]
    assert "No such file" in h.sh("worker", "ls /app/runs/cache 2>&1 || true")  # the warm start stays on the head
    statuses = [json.loads(h.sh("worker", f"cat {remote}/{a}.json")) for a in agents]
    assert [s["agent_id"] for s in statuses] == agents, statuses  # sao up's names, kept across restarts
    assert all(s["host"].startswith("worker") and s["refused"] == {} for s in statuses), statuses
    agent_logs = "".join(h.sh("worker", f"sed 's/^/[{a}] /' {remote}/logs/worker/{a}.log") for a in agents)
    announced = h.policy_versions(host="head", run=run)
    out = tmp_path / "run"
    h.run("cp", f"head:{remote}", str(out))
    assert (out / "config.yaml").read_text() == h.sh("worker", f"cat {remote}/config.yaml")  # the copy, by value

    # Versions: each agent loaded them from the learner's weight server at the head's address, with the learner's
    # checksums; the learner is on the head (its log there), and training moved the weights.
    server = f"http://{ip_of(h, 'head')}:8765"
    agent_cfg = yaml.safe_load((out / "config.yaml").read_text())["agent"]
    assert agent_cfg["model"] == f"{server}/latest" and agent_cfg["weights_url"] == server  # the head's server
    for a in agents:  # each agent's model, fetched from it into a cache of its own on the worker
        assert h.sh("worker", f"ls {remote}/{a}-model").startswith("v000000-")
    loaded = loaded_versions(agent_logs, announced, server)
    assert len({pv["sha256"] for pv in announced.values()}) > 1, "every version has the same weights"
    assert "learner on head" in (out / "logs" / "learner.log").read_text()
    assert not list(out.glob("agent-*.json"))  # nothing of the agents' on the head

    # Trajectories: every task answered by the worker's agents, none trained twice, all but a partial batch trained.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "scenario finished: every task answered", summary["stopped"]
    trajs, learner = read_trajectories(out), read_learner(out)
    assert set(trajs["agent_id"]) == set(agents)  # the worker's agents (their status files name its host)
    trained = assert_trained_once(trajs, learner, TASKS, BATCH)
    assert sum(s["tasks"] for s in statuses) == TASKS

    h.mark("wall_s")
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "test": "tests/test_ray_containers.py", "command": " ".join(cmd), **image,
        **{k: round(v, 1) for k, v in h.times.items()}, "sao_up_s": round(up_s, 1),
        "trajectories": len(trajs), "trained": len(trained), "learner_steps": len(learner),
        "trained_fraction": summary.get("trained_fraction"),
        "versions_loaded": {a: len(v) for a, v in loaded.items()},
        "distinct_version_checksums": len({pv["sha256"] for pv in announced.values()}),
        "agents": {s["agent_id"]: s["tasks"] for s in statuses}}, indent=1) + "\n")

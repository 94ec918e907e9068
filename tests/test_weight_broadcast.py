"""Weights by broadcast (issue 46 item 1): the learner's rank 0 and agent processes in a gloo group of their own.

Real processes (`python -m bench.weights_agent`: an agent's real weight source, and a torch engine), real gloo over
loopback, the real weight server behind for the agents outside the group: nothing shipped is mocked. A death in the
middle of a transfer is a real SIGKILL of the agent process, sent by itself once the first bucket arrived.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from learner.models import ModelConfig, build_policy, load_policy
from learner.trainer.publish import DirectoryPublisher
from streamer.transport.weight_broadcast import Broadcaster, distinct
from streamer.transport.weight_group import Header, pack, plan, received_state, state_digest, unpack
from streamer.transport.weight_server import WeightServer
from streamer.transport.weights import CheckpointError
from streamer.wire.config import ConfigError
from streamer.wire.schema import encode_json

ROOT = Path(__file__).resolve().parents[1]
REPLY_S = 60.0  # an agent answers an announcement within this (a cold process on 2 busy cores is slow)


class Learner:
    """The learner's rank 0 as `learner/train.py` builds it for broadcast: store, weight server, sender."""

    def __init__(self, tmp: Path, bucket_bytes: int, timeout_s: float) -> None:
        self.server = WeightServer(tmp / "store", "127.0.0.1:0").start()
        self.url = f"http://{self.server.address}"
        self.sender = Broadcaster("127.0.0.1:0", bucket_bytes, timeout_s).start()
        self.publisher = DirectoryPublisher(tmp / "store", keep=4, base_uri=self.url, broadcast=self.sender.offer)

    def wait_members(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.sender.stats()["members"]) != n or not self.sender.idle():
            assert time.monotonic() < deadline, f"no group of {n} agents: {self.sender.stats()}"
            time.sleep(0.05)

    def close(self) -> None:
        self.sender.close()
        self.server.close()


class Agent:
    def __init__(self, learner: Learner, *extra: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.weights_agent", "--group", learner.sender.address,
                                      "--url", learner.url, *extra], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.reply()["asked"] and self.reply()["ready"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def reply(self) -> dict:
        got = self.lines.get(timeout=REPLY_S)
        assert got is not None, f"the agent exited ({self.proc.poll()})"
        return got

    def load(self, pv) -> None:
        self.proc.stdin.write(encode_json(pv).decode() + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def processes():
    made: list = []
    yield made
    for p in reversed(made):
        p.close()


def _nudge(model: torch.nn.Module, by: float) -> None:
    """A training step's worth of change, in place (what the sender's copy must not see)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


# ------------------------------------------------------------------------------------------- in one process

def test_buckets_keep_each_tensors_bytes_and_dtype_and_the_digest_sees_every_bit():
    g = torch.Generator().manual_seed(0)
    state = {"b.w": torch.randn(200, 7, generator=g).to(torch.bfloat16), "a.bias": torch.randn(5, generator=g),
             "c.big": torch.randn(40_000, generator=g).half(), "d.count": torch.tensor(3, dtype=torch.int64),
             "e.empty": torch.zeros(0, 4), "f.mask": torch.tensor([True, False])}
    sizes, specs = plan(state, bucket_bytes=4096)
    assert [s.name for s in specs] == sorted(state)  # name order
    assert all(s.offset % 16 == 0 and s.offset + s.nbytes <= sizes[s.bucket] for s in specs)
    big = next(s for s in specs if s.name == "c.big")
    assert sizes[big.bucket] == big.nbytes == 80_000  # larger than a bucket: a bucket of its own
    assert max(n for i, n in enumerate(sizes) if i != big.bucket) <= 4096
    packed = pack(state, version=3, step=30, bucket_bytes=4096)
    assert sum(b.numel() for b in packed.buffers) < sum(t.numel() * t.element_size() for t in state.values()) + 200
    for t in state.values():  # the learner trains on: the copy stays
        t.zero_() if t.dtype != torch.bool else t.logical_not_()
    header = msgspec.json.decode(msgspec.json.encode(packed.header), type=Header)
    got = received_state(header, packed.buffers)
    assert packed.header.digest == state_digest(got) and packed.header.digest != state_digest(state)
    assert got["b.w"].dtype == torch.bfloat16 and got["c.big"].dtype == torch.float16  # never upcast
    assert got["e.empty"].shape == (0, 4) and got["d.count"].item() == 3
    packed.buffers[0][17] ^= 1  # one bit
    with pytest.raises(CheckpointError, match="policy v3: received tensors have digest"):
        received_state(header, packed.buffers)
    assert dict(unpack(header, packed.buffers)).keys() == state.keys()


def test_the_announcement_carries_the_digest_and_the_training_loop_never_waits(tmp_path, tiny_policy_dir):
    learner = Learner(tmp_path, 1 << 20, 5.0)
    try:
        model = load_policy(tiny_policy_dir)
        t0 = time.perf_counter()
        pv = learner.publisher.publish(model, 1, 10)  # no agent: nothing to send to, nothing waited for
        assert time.perf_counter() - t0 < 2.0
        assert pv.tensors_sha256 == state_digest(distinct(model.state_dict())) and len(pv.sha256) == 64
        assert pv.uri == f"{learner.url}/v000001"
    finally:
        learner.close()
    with pytest.raises(ConfigError, match="weights_group_bind: 'nowhere' is not HOST:PORT"):
        Broadcaster("nowhere")


def test_one_launch_setting_sets_the_group_on_both_sides(tmp_path):
    from streamer.launch.run_config import load_run_config
    from streamer.launch.up import roles
    from streamer.wire.settings import AgentSettings

    cfg = load_run_config(None, ["launch.weights_transport=broadcast", "launch.eval=true", "launch.cores=4"])
    io, agent = cfg.learner.io, cfg.agent
    assert io.weights_transport == agent.weights_transport == "broadcast"
    assert agent.weights_group == io.weights_group_bind and int(io.weights_group_bind.rpartition(":")[2]) > 0
    assert agent.weights_url == f"http://{io.weights_bind}" and io.versions_kept() == 4
    [ev] = [r for r in roles(cfg, tmp_path / "config.yaml", tmp_path, "127.0.0.1:9092") if r.name == "eval"]
    assert ev.argv[ev.argv.index("--weights-url") + 1] == agent.weights_url  # the evaluator pulls
    wide = load_run_config(None, ["launch.weights_transport=broadcast", "launch.weights_bind=0.0.0.0:8799",
                                  "launch.weights_advertised=learner-host:8799",
                                  "launch.weights_group_bind=0.0.0.0:29700"])
    assert (wide.learner.io.weights_group_bind, wide.agent.weights_group) == ("0.0.0.0:29700", "learner-host:29700")
    for key in ("agent.weights_group=x:1", "learner.io.weights_group_bind=0.0.0.0:1"):
        with pytest.raises(ConfigError, match=f"{key.partition('=')[0]}: sao up derives it"):
            load_run_config(None, [key])
    with pytest.raises(ConfigError, match="AgentSettings.weights_group"):
        AgentSettings(weights_transport="broadcast", weights_url="http://a:1").validate()


# ------------------------------------------------------------------------------------------- real processes

@pytest.mark.slow
def test_bf16_bit_for_bit_to_two_agents_then_a_late_agent_then_a_restarted_learner(tmp_path, processes):
    learner = Learner(tmp_path, 1 << 20, 20.0)
    processes.append(learner)
    model = build_policy(ModelConfig(), seed=0).to(torch.bfloat16)
    saved = [tmp_path / f"agent{i}" for i in range(3)]
    for d in saved:
        d.mkdir()
    a, b = (Agent(learner, "--save", str(d)) for d in saved[:2])
    processes += [a, b]
    learner.wait_members(2)
    pv = learner.publisher.publish(model, 1, 1)
    for agent in (a, b):
        agent.load(pv)
    sent = distinct(model.state_dict())
    for agent, d in ((a, saved[0]), (b, saved[1])):
        r = agent.reply()
        assert r["version"] == 1 and r["from"] == f"broadcast group {learner.sender.address}", r
        assert r["digest"] == pv.tensors_sha256 == state_digest(sent) and r["dtypes"] == ["torch.bfloat16"]
        from safetensors.torch import load_file

        got = load_file(d / "v1.safetensors")
        assert got.keys() == sent.keys()
        assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], t) for k, t in sent.items())
    assert learner.sender.stats()["sent"] == 1
    c = Agent(learner, "--save", str(saved[2]))  # late: v1 was sent without it
    processes.append(c)
    c.load(pv)
    r = c.reply()
    assert r["from"] == learner.url and r["digest"] == pv.tensors_sha256  # pulled
    learner.wait_members(3)
    _nudge(model, 0.01)
    pv2 = learner.publisher.publish(model, 2, 2)
    for agent in (a, b, c):
        agent.load(pv2)
    for agent in (a, b, c):
        r = agent.reply()
        assert (r["version"], r["from"], r["digest"]) == (2, f"broadcast group {learner.sender.address}",
                                                           pv2.tensors_sha256), r
    assert learner.sender.stats()["failed"] == 0
    address = learner.sender.address  # the learner restarts: a new rendezvous store on the same port
    learner.sender.close()
    learner.sender = Broadcaster(address, 1 << 20, 20.0).start()
    learner.publisher.broadcast = learner.sender.offer
    learner.wait_members(3)  # the agents connected again and asked
    _nudge(model, 0.01)
    pv3 = learner.publisher.publish(model, 3, 3)
    for agent in (a, b, c):
        agent.load(pv3)
    assert [agent.reply()["from"] for agent in (a, b, c)] == [f"broadcast group {address}"] * 3


@pytest.mark.slow
def test_an_agent_killed_mid_transfer_stalls_nothing_and_gets_versions_again_once_restarted(tmp_path, processes,
                                                                                             tiny_policy_dir):
    timeout = 5.0
    learner = Learner(tmp_path, 256 * 1024, timeout)  # ~13 MB of fp32 in ~52 buckets
    processes.append(learner)
    model = load_policy(tiny_policy_dir)
    engine = ("--engine", str(tiny_policy_dir))
    doomed, b = Agent(learner, *engine, "--die-after-bucket", "2"), Agent(learner, *engine)
    processes += [doomed, b]
    learner.wait_members(2)
    publish_s, froms = [], {}
    restarted = None
    for v in range(1, 9):
        if v == 6:  # the sender takes the restarted agent in between versions (it pulls meanwhile)
            learner.wait_members(2)
        _nudge(model, 0.001)  # a training step
        t0 = time.perf_counter()
        pv = learner.publisher.publish(model, v, v)
        publish_s.append(time.perf_counter() - t0)
        live = [x for x in (doomed, b, restarted) if x is not None and x.proc.poll() is None]
        for agent in live:
            agent.load(pv)
        if v == 2:  # the doomed agent dies after the first bucket of v2
            assert doomed.proc.wait(timeout=REPLY_S) == -signal.SIGKILL
            live.remove(doomed)
        for agent in live:
            r = agent.reply()
            assert r["version"] == v == r["engine_version"] and r["digest"] == pv.tensors_sha256, r
            assert r["written"] == [], f"the agent wrote files: {r['written']}"
            froms.setdefault(agent, []).append(r["from"])
        if v == 2:
            restarted = Agent(learner, *engine)
            processes.append(restarted)
    stats = learner.sender.stats()
    assert max(publish_s) < 1.0, publish_s  # the training loop never waited for an agent
    assert stats["groups"] >= 2, stats  # re-formed without the dead agent (its send failed, or it did not ack)
    assert len(stats["members"]) == 2 and not any(f"-{doomed.proc.pid}-" in m for m in stats["members"]), stats
    group = f"broadcast group {learner.sender.address}"
    assert froms[b][0] == group and froms[b][5:] == [group] * 3, froms[b]
    assert len(froms[restarted]) == 6 and froms[restarted][3:] == [group] * 3, froms[restarted]
    assert set(froms[restarted][:3]) <= {group, learner.url}


@pytest.mark.slow
def test_a_stalled_agent_costs_the_sender_its_timeout_not_the_training_loop(tmp_path, processes, tiny_policy_dir):
    timeout = 3.0
    learner = Learner(tmp_path, 64 * 1024, timeout)
    processes.append(learner)
    model = load_policy(tiny_policy_dir)
    stalled, b = Agent(learner), Agent(learner)
    processes += [stalled, b]
    learner.wait_members(2)
    stalled.proc.send_signal(signal.SIGSTOP)  # alive, holding its sockets, reading nothing
    try:
        pv = learner.publisher.publish(model, 1, 1)
        b.load(pv)
        gaps, last, t_end = [], time.perf_counter(), time.perf_counter() + timeout + 2.0
        while time.perf_counter() < t_end:  # training steps while the sender waits on the stalled agent
            _nudge(model, 1e-6)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0.02)
        r = b.reply()
        assert r["version"] == 1 and r["digest"] == pv.tensors_sha256
        assert max(gaps) < 0.5, max(gaps)
        deadline = time.monotonic() + 30
        while learner.sender.stats()["failed"] < 1:
            assert time.monotonic() < deadline, learner.sender.stats()
            time.sleep(0.1)
    finally:
        stalled.proc.send_signal(signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.kafka
def test_up_runs_the_pipeline_with_versions_broadcast_to_two_agents(tmp_path):
    """`sao up --weights-transport broadcast` on the smoke scenario, shortened (two agents, 192 tasks, a 30-step warm
    start): every task answered, both agents loaded versions received in the learner's group, none refused."""
    from test_weight_pull import short_up

    run_dir, cfg = short_up(tmp_path, "b", "broadcast", agents=2)
    group = cfg["agent"]["weights_group"]
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"weight broadcast: rendezvous on {group}" in learner_log
    assert "gloo group of the learner and 2 agents" in learner_log
    tasks = 0
    for i in range(2):
        status = json.loads((run_dir / f"agent-{i}.json").read_text())
        assert status["version"] >= 2 and status["refused"] == {}, status
        tasks += status["tasks"]
        received = (run_dir / "logs" / f"agent-{i}.log").read_text().count(f"loaded from broadcast group {group} ")
        assert received >= 2, f"agent-{i} received {received} versions by broadcast"
    assert tasks == 192

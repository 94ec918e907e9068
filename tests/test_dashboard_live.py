"""The dashboard's live-topic tap: in-memory bus, the real embedded broker, failures as messages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import data
from dashboard.live import LiveTap, close_all, wait_for
from streamer.transport.memory_bus import MemoryBus
from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint
from streamer.wire.topics import Topics, partitions_by_topic

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


def publish(producer, run: str) -> None:
    t = Topics(run)
    for k, v in enumerate([0.8, 0.2, 0.6]):
        producer.send(t.metrics, MetricPoint(name="metrics/reward", value=v, time=10.0 + k, labels={"family": "a"},
                                             trajectories=100 * (k + 1), learner_step=k))
    # the metrics app also emits a {family, concept} level and an overall {} level: not reward lines per family
    producer.send(t.metrics, MetricPoint(name="metrics/reward", value=0.1, time=10.0,
                                         labels={"family": "a", "concept": "c0"}, trajectories=100))
    producer.send(t.metrics, MetricPoint(name="metrics/throughput", value=7.5, time=11.0, trajectories=200))
    producer.send(t.learner, LearnerEvent(step=0, version=1, time=10.5, n_trajectories=4, n_tokens=40,
                                          metrics={"learner/kl": 0.02}, staleness={"1": 4}))
    producer.send(t.drift, DriftEvent(phase=1, prev_phase=0, name="p1", schedule="abrupt", families=["a"],
                                      concepts={"a": "c1"}, at_seq=100, time=10.7))
    producer.flush()


def memory_factory(bus: MemoryBus):
    def make(bootstrap: str, run: str):
        t = Topics(run)
        return bus.consumer({t.metrics: MetricPoint, t.learner: LearnerEvent, t.drift: DriftEvent})
    return make


def check_snapshot(snap: data.RunData) -> None:
    rw = data.reward_frame(snap, window=64)
    # metrics/reward points as published; x_traj from their running trajectory counts
    assert rw["reward_w"].tolist() == [0.8, 0.2, 0.6]
    assert rw["x_traj"].tolist() == [100.0, 200.0, 300.0]
    marks = data.drift_marks(snap)
    # drift at t=10.7: the 10.0 point (100 trajectories) is the last before it
    assert marks["x_traj"].tolist() == [100.0] and marks["x_time"].round(6).tolist() == [0.7]
    assert data.learner_metrics(snap, "kl_entropy")["value"].tolist() == [0.02]
    assert data.staleness_counts(snap)[["staleness", "count"]].values.tolist() == [[1, 4]]
    assert data.throughput(snap)[["metric", "value"]].values.tolist() == [["trajectories/s", 7.5]]


def test_tap_on_memory_bus_deduplicates_after_reconnect():
    bus = MemoryBus()
    bus.create_topics(partitions_by_topic("m1"))
    publish(bus.producer(), "m1")
    tap = LiveTap("memory", "m1", consumer_factory=memory_factory(bus), retry_s=0.05)
    try:
        assert wait_for(lambda: len(tap.snapshot().metrics) == 5 and tap.snapshot().drift, 10)
        assert tap.ok and "live" in tap.status
        check_snapshot(tap.snapshot())
    finally:
        tap.close()


def test_tap_reports_failures_and_retries():
    calls = []

    def failing(bootstrap, run):
        calls.append(run)
        raise RuntimeError("topic 'x.metrics' does not exist (create it first: KafkaBus.create_topics)")

    tap = LiveTap("127.0.0.1:9", "x", consumer_factory=failing, retry_s=0.02)
    try:
        assert wait_for(lambda: len(calls) >= 3, 10)  # keeps retrying
        assert not tap.ok and "run not found on the broker" in tap.status and "127.0.0.1:9" in tap.status
        assert tap.snapshot().empty
    finally:
        tap.close()


@pytest.mark.kafka
def test_app_tails_live_topics_on_the_embedded_broker(kafka_bus, bootstrap, kafka_run, monkeypatch):
    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    p = kafka_bus.producer()
    publish(p, kafka_run)
    p.close()
    tap = LiveTap(bootstrap, kafka_run)
    try:
        assert wait_for(lambda: len(tap.snapshot().metrics) == 5 and tap.snapshot().drift, 60), tap.status
        check_snapshot(tap.snapshot())
    finally:
        tap.close()
    monkeypatch.setattr(sys, "argv", [APP, "--runs", "/nonexistent", "--bootstrap", bootstrap, "--run", kafka_run])
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["auto_refresh"] = False
    at.run()
    # the app's own tap (cached per bootstrap and run) fills in the background: rerun until the chart shows
    assert wait_for(lambda: bool(at.run().get("vega_lite_chart")), 60, every=0.5)
    assert not at.exception
    assert f"**live:{kafka_run}** (live topics)" in [m.value for m in at.markdown]
    assert {m.label: m.value for m in at.metric}["trajectories"] == "300"
    close_all()


@pytest.mark.kafka
def test_tap_survives_a_broker_restart(tmp_path, kafka_run):
    from dashboard.browser import free_port
    from streamer.transport.broker import EmbeddedBroker
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.settings import BrokerSettings

    port = free_port()

    def broker(i: int) -> EmbeddedBroker:
        return EmbeddedBroker(BrokerSettings(port=port, log_path=str(tmp_path / f"b{i}.log"))).start()

    b = broker(0)
    bus = KafkaBus(b.bootstrap)
    bus.create_topics(partitions_by_topic(kafka_run))
    p = bus.producer()
    publish(p, kafka_run)
    p.close()
    tap = LiveTap(b.bootstrap, kafka_run, retry_s=0.5, resync_s=2.0)
    try:
        assert wait_for(lambda: len(tap.snapshot().metrics) == 5, 60), tap.status
        b.stop()
        # the in-memory broker comes back empty on the same port; new points must still arrive
        b = broker(1)
        bus.create_topics(partitions_by_topic(kafka_run))
        p = bus.producer()
        p.send(Topics(kafka_run).metrics, MetricPoint(name="metrics/reward", value=0.9, time=20.0,
                                                      labels={"family": "a"}, trajectories=400))
        p.flush()
        p.close()
        assert wait_for(lambda: len(tap.snapshot().metrics) == 6, 90), tap.status
        assert tap.snapshot().metrics["value"].tolist()[-1] == 0.9
    finally:
        tap.close()
        b.stop()

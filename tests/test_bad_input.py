"""Bad input never stops a consumer and never enters a checkpoint (issue 14): each test failed before its fix."""

from __future__ import annotations

import msgspec
import pytest

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.checkpoint import latest_checkpoint
from learner.trainer.loop import Trainer
from learner.trainer.source import BusSource
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.wire.config import load_config
from streamer.wire.schema import DeadLetter, LearnerEvent, Trajectory


@pytest.mark.kafka
def test_untrainable_trajectories_are_dead_lettered_and_never_checkpointed(tmp_path, kafka_bus, kafka_run):
    """Token ids outside the vocabulary crashed the forward pass (IndexError) on every restart, since the
    trajectory sat in the checkpoint's buffer; too long a trajectory overflowed the positions."""
    from streamer.wire.topics import Topics, partitions_by_topic

    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    topics = Topics(kafka_run)
    model = tiny_model_config()
    policy = build_policy(model, seed=0)
    vocab, positions = policy.config.vocab_size, policy.config.max_position_embeddings
    good = synthetic_trajectories(policy, 6, seed=1)
    out_of_vocab = msgspec.structs.replace(good[0], task_id="oov", traj_id="oov",
                                           tokens=good[0].tokens[:-1] + [vocab + 5])
    n = positions + 1
    too_long = msgspec.structs.replace(good[1], task_id="long", traj_id="long", prompt_len=1, tokens=[1] * n,
                                       loss_mask=[0] + [1] * (n - 1), logprobs=[0.0] + [-1.0] * (n - 1))
    prod = kafka_bus.producer()
    for t in [good[0], out_of_vocab, good[1], too_long] + good[2:]:
        prod.send(topics.trajectories, t, key=t.task_id)
    prod.flush()

    cfg = load_config(LearnerConfig, None, TINY_OVERRIDES + [
        f"checkpoint.dir={tmp_path / 'ck'}", "batch.max_trajectories=4", "batch.tokens=100000",
        "value.warmup_steps=0", "checkpoint.every=1"])
    trained: list[str] = []
    events: list[LearnerEvent] = []

    def sink(e: LearnerEvent) -> None:
        events.append(e)
        trained.extend(e.task_ids)
        trainer.stop = len(trained) >= 4

    source = BusSource(kafka_bus.consumer({topics.trajectories: Trajectory}, group_id=None, dlq=topics.dlq))
    trainer = Trainer(cfg, build_models(cfg), source, None, [sink])
    try:
        trainer.run()
    finally:
        source.close()
    good_ids = {t.task_id for t in good}
    assert len(trained) == 4 and set(trained) <= good_ids  # the topic's partitions interleave: any 4 of them
    pending = (latest_checkpoint(tmp_path / "ck") / "pending.jsonl").read_text()
    assert '"oov"' not in pending and '"long"' not in pending
    assert trainer.admission.counts["invalid"] == 2 and events[-1].metrics["learner/dead_letters"] == 2.0

    dlq = kafka_bus.consumer({topics.dlq: DeadLetter}, group_id=None)
    letters = []
    for _ in range(20):
        letters += [m for m, _, _ in dlq.poll(max_records=10, timeout=0.5)]
        if len(letters) >= 2:
            break
    dlq.close()
    assert len(letters) == 2 and all(x.expected == "Trajectory" for x in letters)
    reasons = {x.reason for x in letters}
    assert f"Trajectory.tokens[{len(good[0].tokens) - 1}]: id {vocab + 5} outside the vocabulary 0..{vocab - 1}" \
        in reasons
    assert f"Trajectory.tokens: {n} tokens > the model's {positions} positions" in reasons

    # a restart from that checkpoint trains the rest and does not crash
    resumed: list[str] = []
    source = BusSource(kafka_bus.consumer({topics.trajectories: Trajectory}, group_id=None, dlq=topics.dlq))
    again = Trainer(cfg, build_models(cfg), source, None, [lambda e: resumed.extend(e.task_ids)])
    again.resume()
    again.cfg.max_steps, again.batcher.max_trajectories = again.step + 1, 2  # the 2 good ones left
    try:
        again.run()
    finally:
        source.close()
    assert sorted(resumed + trained) == sorted(good_ids)


@pytest.mark.kafka
def test_a_send_the_broker_never_confirms_raises_instead_of_returning(tmp_path):
    """kafka-python's flush() returned although the records failed, and the agent then committed its task offsets
    (issue 14, finding 3). Here the broker dies between send and flush."""
    from streamer.transport.broker import EmbeddedBroker
    from streamer.transport.bus import SendError
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.settings import BrokerSettings, ClientSettings

    broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(tmp_path / "tansu.log"))).start()
    try:
        bus = KafkaBus(broker.bootstrap, ClientSettings(client_id="sao-test", request_timeout_ms=1000,
                                                        delivery_timeout_ms=3000))
        bus.create_topics({"lost.trajectories": 1})
        prod = bus.producer()
        policy = build_policy(tiny_model_config(), seed=0)
        t = synthetic_trajectories(policy, 2)
        prod.send("lost.trajectories", t[0], key=t[0].task_id)
        prod.flush()  # confirmed: returns
    finally:
        broker.stop()
    prod.send("lost.trajectories", t[1], key=t[1].task_id)
    with pytest.raises(SendError, match=r"record\(s\) (to lost.trajectories failed|not confirmed)"):
        prod.flush(timeout=10)
    prod.close()


@pytest.mark.kafka
def test_dead_letters_are_not_sent_again_when_a_restarted_consumer_reads_them_again(kafka_bus, kafka_run):
    """Records after the last checkpointed offset are read again after a restart: their dead letters were re-sent
    to the DLQ every time (issue 14, finding 8)."""
    from streamer.wire.topics import Topics, partitions_by_topic

    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    topics = Topics(kafka_run)
    t = synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 2)
    prod = kafka_bus.producer()
    prod.send(topics.trajectories, t[0], key="a")
    prod.send_raw(topics.trajectories, b"\x00not msgpack", key=b"a")
    prod.send(topics.trajectories, t[1], key="a")
    prod.flush()

    def read_all(new_letters: int) -> None:
        c = kafka_bus.consumer({topics.trajectories: Trajectory}, group_id=None, dlq=topics.dlq)
        got = []
        for _ in range(20):
            got += c.poll(max_records=10, timeout=0.5)
            if len(got) >= 2:
                break
        c.close()
        assert len(got) == 2 and c.dead_letters == new_letters and len(c.in_dlq) == 1

    read_all(new_letters=1)
    read_all(new_letters=0)  # a restart from the first offset: the letter is in the DLQ already
    dlq = kafka_bus.consumer({topics.dlq: DeadLetter}, group_id=None)
    letters = []
    for _ in range(6):
        letters += dlq.poll(max_records=10, timeout=0.5)
    dlq.close()
    assert len(letters) == 1 and letters[0].msg.expected == "Trajectory"


def test_kafka_security_settings_reach_every_client_from_config_or_environment(monkeypatch, tmp_path):
    """Only an open PLAINTEXT Kafka worked: no SASL/TLS for any client; faust's web server bound 0.0.0.0
    (issue 14, finding 9)."""
    from streamer.metrics.app import MetricsSettings, build_app
    from streamer.wire.config import ConfigError
    from streamer.wire.settings import KafkaSecurity

    for env in ("SAO_KAFKA_SECURITY_PROTOCOL", "SAO_KAFKA_SASL_MECHANISM", "SAO_KAFKA_SASL_USERNAME",
                "SAO_KAFKA_SASL_PASSWORD", "SAO_KAFKA_SSL_CAFILE"):
        monkeypatch.delenv(env, raising=False)
    assert KafkaSecurity().kafka_python() == {"security_protocol": "PLAINTEXT"}
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    monkeypatch.setenv("SAO_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("SAO_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("SAO_KAFKA_SASL_USERNAME", "sao")
    with pytest.raises(ConfigError, match=r"SASL_SSL needs sasl_username and sasl_password"):
        KafkaSecurity().kafka_python()
    monkeypatch.setenv("SAO_KAFKA_SASL_PASSWORD", "s3cret")
    assert KafkaSecurity(ssl_cafile=str(ca)).kafka_python() == {
        "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "sao",
        "sasl_plain_password": "s3cret", "ssl_cafile": str(ca)}
    assert KafkaSecurity(sasl_username="other").kafka_python()["sasl_plain_username"] == "other"  # config wins
    with pytest.raises(ConfigError, match=r"security.ssl_certfile: /nowhere.pem: no such file"):
        KafkaSecurity(ssl_certfile="/nowhere.pem").kafka_python()
    monkeypatch.setenv("SAO_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    app = build_app(MetricsSettings(run="sec", web_port=6099), "127.0.0.1:1")
    creds = app.conf.broker_credentials
    assert (creds.username, creds.password, creds.mechanism.value) == ("sao", "s3cret", "SCRAM-SHA-512")
    assert app.conf.web_bind == "127.0.0.1"

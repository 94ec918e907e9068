"""The embedded Tansu broker: starts on a free port, answers Kafka requests, stops on SIGINT."""

from __future__ import annotations

import pytest

from streamer.transport.broker import BrokerError, EmbeddedBroker, free_port, probe
from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.schema import Task
from streamer.wire.settings import BrokerSettings

pytestmark = pytest.mark.kafka


def test_broker_starts_answers_metadata_and_stops_on_sigint(tmp_path):
    log_path = tmp_path / "tansu.log"
    broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(log_path))).start()
    try:
        assert probe("127.0.0.1", broker.port)
        bus = KafkaBus(broker.bootstrap)
        assert bus.create_topics({"b.tasks": 2}) == ["b.tasks"]
        assert bus.create_topics({"b.tasks": 2}) == []  # idempotent
        prod = bus.producer()
        prod.send("b.tasks", Task(task_id="x", family="arith", concept="add", prompt="1+1=", answer="2"), key="x")
        prod.flush()
        prod.close()
        cons = bus.consumer({"b.tasks": Task})  # no group: all partitions from the start
        got = []
        for _ in range(20):
            got += cons.poll(10, 0.5)
            if got:
                break
        cons.close()
        assert [p.msg.task_id for p in got] == ["x"]
    finally:
        code = broker.stop()
    assert code == 0  # Tansu exits cleanly on SIGINT
    assert not probe("127.0.0.1", broker.port, timeout=0.3)
    assert "listening on" in log_path.read_text()


def test_probe_is_false_where_nothing_listens():
    assert not probe("127.0.0.1", free_port(), timeout=0.3)


def test_second_broker_on_a_busy_port_is_refused(kafka_broker):
    port = int(kafka_broker.rsplit(":", 1)[1])
    with pytest.raises(BrokerError, match="already answers"):
        EmbeddedBroker(BrokerSettings(port=port)).start()


def test_sao_broker_runs_in_the_foreground_until_sigint(tmp_path):
    import re
    import signal
    import subprocess
    import sys

    # as from a terminal: a test run started in the background (`cmd &` without job control) ignores SIGINT, its
    # children inherit that, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", "broker", "--port", "0", "--log",
                             str(tmp_path / "b.log")], stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        m = re.search(r"broker ready: ([\d.]+):(\d+)", line)
        assert m, line
        assert probe(m.group(1), int(m.group(2)))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert not probe(m.group(1), int(m.group(2)), timeout=0.3)  # the broker child went with it
    finally:
        if proc.poll() is None:
            proc.kill()


def test_advertised_address_is_what_clients_are_told(tmp_path):
    """In a container the broker listens on 0.0.0.0 and tells clients the service name (`sao broker --advertised`)."""
    broker = EmbeddedBroker(BrokerSettings(host="0.0.0.0", advertised="kafka:9092"))
    broker.port = 9092  # as start() sets it
    cmd = broker.command()
    assert cmd[cmd.index("--listener-url") + 1] == "tcp://0.0.0.0:9092"
    assert cmd[cmd.index("--advertised-listener-url") + 1] == "tcp://kafka:9092"
    broker = EmbeddedBroker(BrokerSettings())
    broker.port = 9093
    plain = broker.command()
    assert plain[plain.index("--advertised-listener-url") + 1] == "tcp://127.0.0.1:9093"


def test_sao_topics_creates_the_runs_topics_with_the_project_counts(kafka_bus, kafka_run, capsys):
    from kafka import KafkaAdminClient

    from streamer.launch.topics import main
    from streamer.wire.topics import partitions_by_topic

    assert main(["--bootstrap", kafka_bus.bootstrap, "--run", kafka_run]) == 0
    assert main(["--bootstrap", kafka_bus.bootstrap, "--run", kafka_run]) == 0  # existing topics: fine
    out = capsys.readouterr().out
    assert out.count("created") == len(partitions_by_topic(kafka_run))  # the first call only
    admin = KafkaAdminClient(bootstrap_servers=kafka_bus.bootstrap)
    try:
        topics = admin.describe_topics(list(partitions_by_topic(kafka_run)))
        described = {t.get("topic", t.get("name")): len(t["partitions"]) for t in topics}
    finally:
        admin.close()
    assert described == partitions_by_topic(kafka_run)


@pytest.mark.slow  # 30 s every time although it passes --wait 1: each connect attempt blocks ~30 s
def test_sao_topics_gives_up_with_the_address_when_no_broker_answers(capsys):
    from streamer.launch.topics import main

    port = free_port()
    assert main(["--bootstrap", f"127.0.0.1:{port}", "--run", "x", "--wait", "1"]) == 1
    assert f"no broker answered at 127.0.0.1:{port} within 1 s" in capsys.readouterr().err
    assert main(["--run", "bad.name", "--wait", "0"]) == 1
    assert "run name 'bad.name'" in capsys.readouterr().err

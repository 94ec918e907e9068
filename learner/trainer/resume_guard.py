"""A resume refuses a broker that does not hold what its checkpoint read.

The checkpoint's positions are the next offset to read, per partition of `<run>.trajectories`. A broker that
restarted empty (the embedded Tansu keeps its topics in memory) or another cluster has topics that end before them:
the learner would wait past the topic's end while the replayed stream's records, at the offsets it already passed,
are never read, and the tasks they answer are dropped as duplicates. So before seeking, each position p > 0 must
have a record at p - 1 (or later). Apache Kafka's end offsets say so directly; Tansu's ListOffsets answers can be
short of the real end, so a short end is confirmed by fetching from p - 1 before the resume is refused. When the
checkpoint holds the cluster id it read from, a broker reporting another one is refused too: that catches a restarted
embedded broker (a new id at each start) even once the replayed stream has grown past the positions.
"""

from __future__ import annotations

import time
from typing import Any

from kafka.structs import TopicPartition

from streamer.wire.config import Refusal

CONFIRM_S = 5.0  # how long a fetch from p - 1 may take to bring a record before the partition counts as short
_CLIENT_KEYS = ("bootstrap_servers", "client_id", "security_protocol", "api_version", "request_timeout_ms")


class ResumeRefused(Refusal):
    """The checkpoint's positions lie beyond the broker's topics, or another cluster (`sao learn` exits 78)."""


def short_partitions(consumer: Any, positions: dict[TopicPartition, int],
                     confirm_s: float = CONFIRM_S) -> dict[TopicPartition, int]:
    """{partition: its end offset} for each position p > 0 whose partition holds no record at p - 1 or later.
    `consumer` is a kafka-python KafkaConsumer (its settings are reused by the confirming fetch)."""
    wanted = {tp: n for tp, n in positions.items() if n > 0}
    if not wanted:
        return {}
    ends = consumer.end_offsets(list(wanted))
    short = {tp: int(ends.get(tp) or 0) for tp, n in wanted.items() if int(ends.get(tp) or 0) < n}
    if short:
        held = _reached(consumer.config, {tp: wanted[tp] - 1 for tp in short}, confirm_s)
        short = {tp: end for tp, end in short.items() if tp not in held}
    return short


def _reached(config: dict, offsets: dict[TopicPartition, int], wait_s: float) -> set[TopicPartition]:
    """The partitions that hand out a record at or after their offset within `wait_s`."""
    from kafka import KafkaConsumer

    settings = {k: v for k, v in config.items() if k in _CLIENT_KEYS or k.startswith(("ssl_", "sasl_"))}
    probe = KafkaConsumer(**settings, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest")
    found: set[TopicPartition] = set()
    try:
        probe.assign(list(offsets))
        for tp, n in offsets.items():
            probe.seek(tp, n)
        deadline = time.monotonic() + wait_s
        while len(found) < len(offsets) and time.monotonic() < deadline:
            for tp, records in probe.poll(timeout_ms=250).items():
                if any(r.offset >= offsets[tp] for r in records):
                    found.add(tp)
    finally:
        probe.close(autocommit=False)
    return found


def refusal(short: dict[TopicPartition, int], positions: dict[TopicPartition, int], bootstrap: str) -> str:
    """What a refused resume says: the run, each short partition with its end and the checkpoint's position, what to
    do."""
    first = min(short)
    run = first.topic.rpartition(".")[0] or first.topic
    where = "; ".join(f"{tp.topic}[{tp.partition}] ends at offset {end}, the checkpoint resumes at {positions[tp]}"
                      for tp, end in sorted(short.items()))
    return (f"refusing to resume run {run!r}: the broker at {bootstrap} does not hold the records this checkpoint "
            f"already read ({where}). It restarted empty (the embedded broker keeps its topics in memory) or it is "
            f"another cluster; resuming would skip the replayed records and drop their tasks as duplicates. Start a "
            f"new run (sao up --run NAME, or another learner checkpoint.dir) or point at the original broker.")


def cluster_id(consumer: Any) -> str | None:
    """The id the broker's Metadata answer carries (None from brokers that send none)."""
    consumer.topics()  # a Metadata request
    return consumer._client.cluster.cluster_id  # kafka-python keeps it on the client's ClusterMetadata only


def check_resume(consumer: Any, positions: dict[TopicPartition, int], cluster: str | None = None,
                 confirm_s: float = CONFIRM_S) -> None:
    """Raise ResumeRefused when the broker is another cluster than `cluster` (the checkpoint's, if it has one) or its
    topics end before the checkpoint's positions."""
    bootstrap = ",".join(consumer.config["bootstrap_servers"])
    now = cluster_id(consumer) if cluster else None
    if cluster and now and now != cluster:
        run = min(positions).topic.rpartition(".")[0] if positions else "?"
        raise ResumeRefused(f"refusing to resume run {run!r}: its checkpoint read from cluster {cluster!r}, the "
                            f"broker at {bootstrap} is cluster {now!r} (restarted empty, or another cluster), so the "
                            f"checkpoint's positions mean nothing there. Start a new run (sao up --run NAME, or "
                            f"another learner checkpoint.dir) or point at the original broker.")
    short = short_partitions(consumer, positions, confirm_s)
    if short:
        raise ResumeRefused(refusal(short, positions, bootstrap))

"""Kafka transport (kafka-python): producers whose flush confirms every send, consumers with a dead-letter topic,
topic creation, and reading a topic to its end. The interface and the DLQ logic are `streamer.transport.bus`'s."""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka.structs import TopicPartition

from streamer.transport.bus import DLQ_MAX_VALUE_BYTES, ENVELOPE_BYTES, Consumer, Producer, RawRecord, SendError
from streamer.transport.gaps import GapGuard
from streamer.wire.schema import DeadLetter, SchemaError, decode
from streamer.wire.settings import ClientSettings

log = logging.getLogger(__name__)

STALL_S = 5.0  # a Kafka consumer that got nothing this long checks for partitions it stopped fetching


def compression_type(setting: str) -> str | None:
    """'auto': lz4 when its codec is installed, else none.

    Measured (bench/transport.py, 3 KB trajectories, 2 cores): gzip cuts producer throughput 3-5x for
    a 34% size cut; lz4 keeps it (27% cut, which matters on the in-memory broker)."""
    from kafka import codec

    if setting == "auto":
        return "lz4" if codec.has_lz4() else None
    return None if setting == "none" else setting


class KafkaProducerClient(Producer):
    def __init__(self, bootstrap: str, settings: ClientSettings, **overrides: Any) -> None:
        from kafka import KafkaProducer

        cfg = dict(bootstrap_servers=bootstrap.split(","), client_id=settings.client_id, acks="all",
                   enable_idempotence=settings.idempotence, retries=float("inf"),  # bounded by delivery_timeout_ms
                   compression_type=compression_type(settings.compression), linger_ms=settings.linger_ms,
                   # a batch of several records stays under every topic's max.message.bytes (topic_configs)
                   batch_size=min(settings.batch_size, settings.max_message_bytes + ENVELOPE_BYTES),
                   request_timeout_ms=settings.request_timeout_ms,
                   delivery_timeout_ms=max(settings.delivery_timeout_ms,
                                           settings.request_timeout_ms + settings.linger_ms),
                   max_request_size=max(DLQ_MAX_VALUE_BYTES, settings.max_message_bytes) + ENVELOPE_BYTES,
                   **settings.security.kafka_python())
        cfg.update(overrides)
        self._p = KafkaProducer(**cfg)
        self._unconfirmed: list[tuple[str, Any]] = []

    def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> Any:
        future = self._p.send(topic, value=value, key=key)  # FutureRecordMetadata
        self._unconfirmed.append((topic, future))
        return future

    def flush(self, timeout: float | None = None) -> None:
        """kafka-python's flush() returns even when records failed: check every future since the last flush."""
        from kafka.errors import KafkaTimeoutError

        sent, self._unconfirmed = self._unconfirmed, []
        try:
            self._p.flush(timeout=timeout)
        except KafkaTimeoutError as e:
            raise SendError(f"{len(sent)} record(s) not confirmed by the broker within {timeout} s: {e}") from e
        failed = [(topic, f.exception) for topic, f in sent if not f.is_done or f.failed()]
        if failed:
            topics = sorted({t for t, _ in failed})
            raise SendError(f"{len(failed)} of {len(sent)} record(s) to {', '.join(topics)} failed after the "
                            f"producer's retries: {type(failed[0][1]).__name__}: {failed[0][1]}")

    def close(self) -> None:
        self._p.close(timeout=5)


class KafkaConsumerClient(Consumer):
    def __init__(self, bootstrap: str, settings: ClientSettings, types: dict[str, type], group_id: str | None,
                 dlq: str | None, producer: Producer | None, name: str | None = None, **overrides: Any) -> None:
        from kafka import ConsumerRebalanceListener, KafkaConsumer

        super().__init__(types, dlq, producer, settings.max_message_bytes, name or group_id or settings.client_id)
        cfg = dict(bootstrap_servers=bootstrap.split(","), client_id=settings.client_id, group_id=group_id,
                   enable_auto_commit=False, auto_offset_reset="earliest",  # Tansu: 'latest' is unreliable
                   session_timeout_ms=settings.session_timeout_ms,
                   heartbeat_interval_ms=settings.heartbeat_interval_ms,
                   max_poll_interval_ms=settings.max_poll_interval_ms, check_crcs=True,
                   request_timeout_ms=max(settings.request_timeout_ms, settings.session_timeout_ms + 5000),
                   **settings.security.kafka_python())
        cfg.update(overrides)
        self._c = KafkaConsumer(**cfg)
        self._gaps = GapGuard(self._c.seek)  # Tansu can answer a fetch past an offset not yet visible
        self._last_records = time.monotonic()
        self._seek_on_assign: dict[TopicPartition, int] = {}
        if dlq is not None and producer is not None:
            self.in_dlq = letters_in(bootstrap, settings, dlq, self.name)
        outer = self

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                outer._forget(revoked)
                outer._gaps.forget(revoked)

            def on_partitions_assigned(self, assigned):
                for tp in assigned:
                    if tp in outer._seek_on_assign:
                        outer._c.seek(tp, outer._seek_on_assign.pop(tp))

        if group_id is not None:
            self._c.subscribe(list(types), listener=_Listener())
        else:
            tps = self._all_partitions(list(types))
            self._c.assign(tps)
            self.tracks_commits = False
            for tp, n in self._c.beginning_offsets(tps).items():  # read from the start: nothing skipped there either
                self._gaps.expect(tp, n)

    def _all_partitions(self, topics: list[str], wait_s: float = 10.0) -> list[TopicPartition]:
        deadline = time.monotonic() + wait_s
        tps: list[TopicPartition] = []
        for t in topics:
            parts = self._c.partitions_for_topic(t)
            while not parts and time.monotonic() < deadline:
                time.sleep(0.1)
                parts = self._c.partitions_for_topic(t)
            if not parts:
                raise RuntimeError(f"topic {t!r} does not exist (create it first: KafkaBus.create_topics)")
            tps += [TopicPartition(t, p) for p in sorted(parts)]
        return tps

    def _raw_poll(self, max_records: int, timeout: float) -> list[RawRecord]:
        batches = self._c.poll(timeout_ms=int(timeout * 1000), max_records=max_records)
        out = [RawRecord(tp, r.offset, r.key, r.value) for tp, recs in batches.items()
               for r in self._gaps.admit(tp, recs)]
        now = time.monotonic()
        if out:
            self._last_records = now
        elif now - self._last_records > STALL_S:
            self._unstall()
            self._last_records = now
        return out

    def keep_membership(self) -> None:
        c = self._c
        coordinator = getattr(c, "_coordinator", None)  # kafka-python's: a settled group costs no wait
        if coordinator is not None and not coordinator.need_rejoin():
            return
        c.pause(*c.assignment())
        got = c.poll(timeout_ms=500, max_records=1)  # joins a rebalance; a paused partition returns no record
        for tp, recs in got.items():  # assigned during this poll, so not paused: its record is given back
            c.seek(tp, recs[0].offset)
        c.resume(*c.paused())

    def _unstall(self) -> None:
        """Seen on the embedded broker after a consumer restart: polls return nothing while a partition still has
        records after the consumer's position. Seeking to the position itself restarts that partition's fetch."""
        tps = sorted(self._c.assignment())
        if not tps:
            return
        end = self._c.end_offsets(tps)
        for tp in tps:
            pos = self._c.position(tp)
            if pos is not None and end.get(tp, 0) > pos:
                log.warning("%s: %s[%d] at %d of %d but no records for %.0f s: fetching it again", self.name,
                            tp.topic, tp.partition, pos, end[tp], STALL_S)
                self._c.seek(tp, pos)

    def _raw_commit(self, offsets: dict[TopicPartition, int]) -> bool:
        from kafka.errors import CommitFailedError, IllegalStateError, RebalanceInProgressError
        from kafka.structs import OffsetAndMetadata

        if self._c.config["group_id"] is None:
            return True  # no group: nothing to commit to (the caller keeps its positions)
        try:
            self._c.commit({tp: OffsetAndMetadata(n, "", -1) for tp, n in offsets.items()})
            return True
        except (CommitFailedError, IllegalStateError, RebalanceInProgressError) as e:  # redelivered to the new owner
            log.warning("%s: commit of %s failed (partitions reassigned?): %s", self.name, offsets, e)
            return False

    def seek(self, offsets: dict[TopicPartition, int]) -> None:
        assigned = self._c.assignment()
        for tp, n in offsets.items():
            self._gaps.expect(tp, n)
            if tp in assigned:
                self._c.seek(tp, n)
                self._forget([tp])
            else:
                self._seek_on_assign[tp] = n

    def assignment(self) -> set[TopicPartition]:
        return set(self._c.assignment())

    def position(self, tp: TopicPartition) -> int:
        return self._c.position(tp)

    def close(self) -> None:
        self._c.close(autocommit=False)


def read_topic(bootstrap: str, settings: ClientSettings, topic: str, timeout_s: float = 15.0,
               idle_polls: int = 2) -> list[tuple[int, int, bytes]]:
    """(partition, offset, value) of every record of `topic`, read from the start until every partition has
    reached its end offset and `idle_polls` polls of 0.25 s in a row brought nothing (the embedded broker's end
    offsets can be short). Raises TimeoutError after `timeout_s`."""
    from kafka import KafkaConsumer

    c = KafkaConsumer(bootstrap_servers=bootstrap.split(","), client_id=settings.client_id, group_id=None,
                      enable_auto_commit=False, request_timeout_ms=settings.request_timeout_ms,
                      **settings.security.kafka_python())
    out: list[tuple[int, int, bytes]] = []
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or ())]
        if not tps:
            return out
        c.assign(tps)
        c.seek_to_beginning(*tps)
        end = c.end_offsets(tps)
        deadline, idle = time.monotonic() + timeout_s, 0
        while idle < idle_polls or any(c.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: not read to its end within {timeout_s} s")
            batches = c.poll(timeout_ms=250)
            idle = 0 if batches else idle + 1
            out += [(r.partition, r.offset, r.value) for records in batches.values() for r in records]
    finally:
        c.close(autocommit=False)
    return out


def letters_in(bootstrap: str, settings: ClientSettings, dlq: str, name: str,
               timeout_s: float = 15.0) -> set[tuple[str, int, int]]:
    """(topic, partition, offset) of every dead letter consumer `name` has sent to `dlq`: a consumer restarted from
    older offsets reads those records again and must not send their letters twice. The DLQ is small (bad input
    only); it is read whole at the consumer's creation."""
    try:
        records = read_topic(bootstrap, settings, dlq, timeout_s)
    except TimeoutError:
        raise SendError(f"{dlq}: could not read the dead letters already sent within {timeout_s} s") from None
    found: set[tuple[str, int, int]] = set()
    for _, _, value in records:
        try:
            letter = decode(value, DeadLetter)
        except SchemaError:
            continue
        if letter.consumer == name:
            found.add((letter.topic, letter.partition, letter.offset))
    return found


class KafkaBus:
    """Clients for one Kafka (or Tansu) cluster, with the project's defaults."""

    def __init__(self, bootstrap: str | None = None, settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings()
        self.bootstrap = bootstrap or self.settings.resolved_bootstrap()

    def producer(self, **overrides: Any) -> KafkaProducerClient:
        return KafkaProducerClient(self.bootstrap, self.settings, **overrides)

    def consumer(self, types: dict[str, type], group_id: str | None = None, dlq: str | None = None,
                 producer: Producer | None = None, name: str | None = None,
                 **overrides: Any) -> KafkaConsumerClient:
        """group_id None: read every partition from the start, no commits (taps, dashboards). `name`: the consumer
        its dead letters are sent under (default: the group, else the client id)."""
        if dlq is not None and producer is None:
            producer = self.producer()
        return KafkaConsumerClient(self.bootstrap, self.settings, types, group_id, dlq, producer, name, **overrides)

    def create_topics(self, partitions: dict[str, int], replication_factor: int = 1) -> list[str]:
        """Create the missing topics with `topic_configs`; returns those created. An existing topic with fewer
        partitions than asked gets more where the broker can add them (Apache Kafka; Tansu cannot), else a
        warning: its partition count caps the consumers of a group that get records."""
        from kafka import KafkaAdminClient
        from kafka.errors import TopicAlreadyExistsError

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","), client_id=self.settings.client_id,
                                 **self.settings.security.kafka_python())
        try:
            existing = set(admin.list_topics())
            new = {t: {"num_partitions": n, "replication_factor": replication_factor,
                       "configs": topic_configs(t, self.settings)} for t, n in partitions.items() if t not in existing}
            if new:
                try:
                    admin.create_topics(new)
                except TopicAlreadyExistsError:
                    pass  # another process created it first
            _grow(admin, {t: n for t, n in partitions.items() if t in existing})
            return list(new)
        finally:
            admin.close()


def topic_configs(topic: str, settings: ClientSettings) -> dict[str, str]:
    """A topic's configuration at creation: its largest record batch, a value of `max_message_bytes` with its
    framing (the DLQ: a dead letter of up to DLQ_MAX_VALUE_BYTES). Apache Kafka enforces it per topic whatever the
    broker's own default (1 MiB); Tansu stores it (DescribeConfigs returns it) and does not enforce it."""
    value = settings.max_message_bytes
    if topic.rpartition(".")[2] == "dlq":
        value = max(value, DLQ_MAX_VALUE_BYTES)
    return {"max.message.bytes": str(value + ENVELOPE_BYTES)}


def _grow(admin: Any, wanted: dict[str, int]) -> dict[str, int]:
    """Add partitions to existing topics that have fewer than `wanted`; returns those still short (count had)."""
    from kafka.errors import KafkaError

    if not wanted:
        return {}
    have = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(list(wanted))}
    short = {t: have[t] for t, n in wanted.items() if t in have and have[t] < n}
    for t, had in list(short.items()):
        try:
            admin.create_partitions({t: wanted[t]})
            log.warning("%s: had %d partitions, %d wanted: partitions added", t, had, wanted[t])
            del short[t]
        except KafkaError as e:
            log.warning("%s: %d partitions, fewer than the %d wanted (one per agent): only %d consumers of a group "
                        "get records, the others sit idle; the broker did not add partitions (%s: %s). Delete the "
                        "topic or use a new run name.", t, had, wanted[t], had, type(e).__name__, e)
    return short

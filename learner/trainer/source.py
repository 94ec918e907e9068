"""Where the learner's trajectories come from: a tiny interface and two implementations.

A source hands out `(Trajectory, Offset)` records in order and can `seek` to positions (the next
offset to read, per partition). The learner keeps the positions itself and stores them in its
checkpoint; on restart it seeks there, so a record is trained exactly once whatever the moment of a
crash. `commit` only mirrors them to the transport (Kafka consumer-group lag); it is never the truth.

    FileSource  a recorded trajectory JSONL file (slime-style record/replay, no broker); offsets are
                byte positions, so a file still being appended to (`follow=True`) works too
    BusSource   a `streamer.transport.bus` consumer (Kafka or in-memory) over `<run>.trajectories`
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import NamedTuple, Protocol

from streamer.wire.schema import SchemaError, Trajectory, decode_json, encode_json

log = logging.getLogger(__name__)


class Offset(NamedTuple):
    partition: str  # "file" or "<topic>:<partition>"
    offset: int  # this record's offset; the position after it is offset + 1 (bytes: the next line)
    next: int  # the position to resume from once this record is consumed


Positions = dict[str, int]


class Source(Protocol):
    # a live topic: every version its trajectories claim was published by this learner (admission bounds them)
    live: bool

    def poll(self, max_records: int, timeout_s: float) -> list[tuple[Trajectory, Offset]]: ...

    def seek(self, positions: Positions, cluster: str | None = None) -> None:
        """Resume at `positions`; `cluster` is the cluster id the checkpoint read from (None: unknown)."""
        ...

    def cluster_id(self) -> str | None:
        """The id of the cluster the records come from, for the checkpoint (None: none)."""
        ...

    def commit(self, positions: Positions) -> None: ...

    def reject(self, traj: Trajectory, off: Offset, reason: str) -> None:
        """A record the learner cannot train on (its admission says why): dead-lettered or counted."""
        ...

    @property
    def dead_letters(self) -> int:
        """Records dead-lettered over the run (a topic: every letter of this consumer in the DLQ, restarts
        included), or, a file, lines skipped since it was opened."""
        ...

    @property
    def exhausted(self) -> bool:
        """True once a finite source has handed out everything it will ever have."""
        ...

    def close(self) -> None: ...


class FileSource:
    """Trajectories from a JSONL file (one `encode_json(Trajectory)` per line).

    Undecodable lines are skipped, counted in `bad_lines` and logged with file:line. With
    `follow=True` the source waits for more lines at the end of the file instead of ending."""

    PARTITION = "file"
    live = False  # a recording (even one still written) may carry another run's version numbers

    def __init__(self, path: str | Path, follow: bool = False) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"trajectory file {self.path}: not found")
        self.follow = follow
        self._f = self.path.open("rb")
        self._pos = 0
        self._at_end = False
        self.bad_lines = 0

    def seek(self, positions: Positions, cluster: str | None = None) -> None:
        self._pos = positions.get(self.PARTITION, 0)
        self._f.seek(self._pos)
        self._at_end = False

    def poll(self, max_records: int, timeout_s: float) -> list[tuple[Trajectory, Offset]]:
        out: list[tuple[Trajectory, Offset]] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < max_records:
            line = self._f.readline()
            if not line.endswith(b"\n"):  # end of file, or a line still being written
                self._f.seek(self._pos)
                if not self.follow or out or time.monotonic() >= deadline:
                    self._at_end = not self.follow
                    break
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            start, self._pos = self._pos, self._pos + len(line)
            if not line.strip():
                continue
            try:
                traj = decode_json(line, Trajectory)
            except SchemaError as e:
                self.bad_lines += 1
                log.warning("%s@byte %d: skipped: %s", self.path, start, e)
                continue
            out.append((traj, Offset(self.PARTITION, start, self._pos)))
        return out

    def commit(self, positions: Positions) -> None:
        pass  # the checkpoint holds the positions; a file has nothing to tell

    def cluster_id(self) -> str | None:
        return None  # a file belongs to no cluster

    @property
    def dead_letters(self) -> int:
        return self.bad_lines

    def reject(self, traj: Trajectory, off: Offset, reason: str) -> None:
        self.bad_lines += 1
        log.warning("%s@byte %d: not trainable: %s", self.path, off.offset, reason)

    @property
    def exhausted(self) -> bool:
        return self._at_end

    def close(self) -> None:
        self._f.close()


def write_trajectories(path: str | Path, trajectories, append: bool = True) -> Path:
    """Record trajectories as JSONL (the format FileSource reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab" if append else "wb") as f:
        for t in trajectories:
            f.write(encode_json(t) + b"\n")
    return path


class BusSource:
    """Trajectories from a `streamer.transport.bus.Consumer` (KafkaConsumerClient or MemoryConsumer).

    Build the consumer with group_id=None for a lone learner: it is assigned every partition at
    once (no group join), and the positions from the checkpoint are the only offsets that count."""

    live = True

    def __init__(self, consumer) -> None:
        self.consumer = consumer
        self._cluster: str | None = None

    @staticmethod
    def _key(tp) -> str:
        return f"{tp.topic}:{tp.partition}"

    def seek(self, positions: Positions, cluster: str | None = None) -> None:
        """Resume at a checkpoint's positions; refused (ResumeRefused) when the broker's topics end before them or,
        given the checkpoint's `cluster` id, the broker is another cluster."""
        from kafka.structs import TopicPartition

        from learner.trainer.resume_guard import check_resume

        tps = {}
        for key, n in positions.items():
            topic, _, part = key.rpartition(":")
            tps[TopicPartition(topic, int(part))] = n
        kafka = self._kafka()
        if tps and kafka is not None:
            check_resume(kafka, tps, cluster)
        if tps:
            self.consumer.seek(tps)

    def _kafka(self):
        return getattr(self.consumer, "_c", None)  # KafkaConsumerClient's kafka-python consumer; in-memory: none

    def cluster_id(self) -> str | None:
        """The broker's cluster id (for the checkpoint), read once; None in memory or from a broker without one."""
        from learner.trainer.resume_guard import cluster_id

        if self._cluster is None and self._kafka() is not None:
            self._cluster = cluster_id(self._kafka())
        return self._cluster

    def poll(self, max_records: int, timeout_s: float) -> list[tuple[Trajectory, Offset]]:
        out = []
        for msg, tp, offset in self.consumer.poll(max_records=max_records, timeout=timeout_s):
            if isinstance(msg, Trajectory):
                out.append((msg, Offset(self._key(tp), offset, offset + 1)))
        return out

    @property
    def dead_letters(self) -> int:
        c = self.consumer
        return len(c.in_dlq) if c.dlq is not None else c.dead_letters

    def reject(self, traj: Trajectory, off: Offset, reason: str) -> None:
        from kafka.structs import TopicPartition

        topic, _, part = off.partition.rpartition(":")
        self.consumer.reject(traj, TopicPartition(topic, int(part)), off.offset, reason)

    def commit(self, positions: Positions) -> None:
        from kafka.structs import TopicPartition

        tps = {TopicPartition(k.rpartition(":")[0], int(k.rpartition(":")[2])): n for k, n in positions.items()}
        if tps:
            self.consumer.commit(tps)

    @property
    def exhausted(self) -> bool:
        return False  # a stream never ends

    def close(self) -> None:
        self.consumer.close()

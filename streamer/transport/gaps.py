"""A reader's guard against offsets skipped at the head of a partition.

Measured on the embedded broker (Tansu) with 8 producers writing one partition (bench/trajectory_partition.py): a
fetch at offset n now and then answers with records from n+1 on, n being written but not yet visible; kafka-python's
position then moves past n and the reader never sees it (3 of 4,000 trajectories lost in one run), though the topic
holds it (a reader from the start finds all). Seeking back to n and fetching again gets it. Apache Kafka serves
only up to the high watermark, and idempotent producers without transactions leave no gaps in a partition's
offsets: there, a gap is real (compaction, retention) and is accepted after `wait_s`.

    guard = GapGuard(consumer.seek)
    for tp, records in consumer.poll().items():
        delivered = guard.admit(tp, records)  # the records before the first gap; at a gap, a seek back to it
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

log = logging.getLogger(__name__)

GAP_WAIT_S = 10.0  # a gap is fetched again this long before it is taken as real


class GapGuard:
    def __init__(self, seek: Callable[[Any, int], None], wait_s: float = GAP_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seek, self.wait_s, self.clock = seek, wait_s, clock
        self._next: dict[Any, int] = {}  # partition -> offset expected next (unknown until its first record)
        self._gap: dict[Any, tuple[int, float]] = {}  # partition -> (missing offset, first seen missing)
        self.refetches = 0  # seeks back to a missing offset
        self.accepted = 0  # gaps taken as real after wait_s

    def expect(self, tp: Any, offset: int) -> None:
        """The consumer was sought to `offset` (a checkpoint, the start of a partition)."""
        self._next[tp] = offset
        self._gap.pop(tp, None)

    def forget(self, tps: Iterable[Any]) -> None:
        for tp in tps:
            self._next.pop(tp, None)
            self._gap.pop(tp, None)

    def admit(self, tp: Any, records: Sequence[Any]) -> list[Any]:
        """`records` (of one partition, in offset order) up to the first gap; at a gap, seek back to it."""
        out = []
        for r in records:
            want = self._next.get(tp)
            if want is not None and r.offset > want:
                if self._gap.get(tp, (None,))[0] != want:
                    self._gap[tp] = (want, self.clock())
                if self.clock() - self._gap[tp][1] < self.wait_s:
                    self.refetches += 1
                    self.seek(tp, want)
                    break
                self.accepted += 1
                log.warning("%s[%s]: offsets %d..%d missing after %.0f s of fetching again: taken as a real gap",
                            getattr(tp, "topic", tp), getattr(tp, "partition", ""), want, r.offset - 1, self.wait_s)
            self._gap.pop(tp, None)
            self._next[tp] = r.offset + 1
            out.append(r)
        return out

"""Optional live view: tail a run's `<run>.metrics`, `<run>.learner` and `<run>.drift` topics.

A `LiveTap` polls in a daemon thread, so the page never blocks on the broker; it reconnects after
any failure (broker down or restarted, topics missing) and reports its state as one line of text.
Rows are de-duplicated by content, so re-reading a topic from the start after a reconnect adds
nothing twice.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

import msgspec
import pandas as pd

from dashboard.data import RunData
from streamer import artifacts as art
from streamer.schema import DriftEvent, LearnerEvent, MetricPoint

RETRY_S = 3.0
_TAPS: "weakref.WeakSet[LiveTap]" = weakref.WeakSet()


def kafka_consumer_factory(bootstrap: str, run: str):
    """A consumer of the run's three topics, from their start, with no group (read-only tap)."""
    from streamer.bus import KafkaBus
    from streamer.topics import Topics

    t = Topics(run)
    types = {t.metrics: MetricPoint, t.learner: LearnerEvent, t.drift: DriftEvent}
    return KafkaBus(bootstrap).consumer(types, group_id=None)


class LiveTap:
    def __init__(self, bootstrap: str, run: str, consumer_factory: Callable[[str, str], Any] | None = None,
                 retry_s: float = RETRY_S):
        self.bootstrap, self.run, self.retry_s = bootstrap, run, retry_s
        self.factory = consumer_factory or kafka_consumer_factory
        self.lock = threading.Lock()
        self.rows: dict[str, list[dict]] = {"metrics": [], "learner": [], "drift": []}
        self.seen: set[bytes] = set()
        self.status = f"connecting to {bootstrap} for run '{run}'..."
        self.ok = False
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"live-{run}", daemon=True)
        self.thread.start()
        _TAPS.add(self)

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            consumer = None
            try:
                consumer = self.factory(self.bootstrap, self.run)
                self._set_status(True, f"live: {self.bootstrap}, run '{self.run}'")
                while not self.stop_event.is_set():
                    self._add(consumer.poll(max_records=2000, timeout=0.5))
            except Exception as e:  # any broker or client failure: report it, retry; the page keeps working
                self._set_status(False, f"broker {self.bootstrap}, run '{self.run}': {_reason(e)} "
                                        f"(retrying every {self.retry_s:g} s)")
            finally:
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:
                        pass
            self.stop_event.wait(self.retry_s)

    def _set_status(self, ok: bool, text: str) -> None:
        with self.lock:
            self.ok, self.status = ok, text

    def _add(self, polled) -> None:
        with self.lock:
            for p in polled:
                msg = p.msg if hasattr(p, "msg") else p
                key = msgspec.json.encode(msg)
                if key in self.seen:
                    continue
                self.seen.add(key)
                if isinstance(msg, MetricPoint):
                    self.rows["metrics"].append(art.metric_row(msg))
                elif isinstance(msg, LearnerEvent):
                    self.rows["learner"].append(art.learner_row(msg))
                elif isinstance(msg, DriftEvent):
                    self.rows["drift"].append(msgspec.to_builtins(msg))

    def snapshot(self) -> RunData:
        with self.lock:
            metrics, learner = pd.DataFrame(self.rows["metrics"]), pd.DataFrame(self.rows["learner"])
            drift = sorted(self.rows["drift"], key=lambda e: e.get("time", 0.0))
        return RunData(name=f"live:{self.run}", trajectories=pd.DataFrame(), learner=learner, metrics=metrics,
                       drift=drift)

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)


def close_all() -> None:
    """Stop every tap of this process (tests; the server's taps end with it)."""
    for tap in list(_TAPS):
        tap.close()


def _reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    if type(e).__name__ == "NoBrokersAvailable":
        return "broker not reachable"
    if "does not exist" in text:
        return f"run not found on the broker ({text})"
    return f"{type(e).__name__}: {text}"[:300]


def wait_for(predicate: Callable[[], bool], timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()

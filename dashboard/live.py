"""Optional live view: tail a run's `<run>.metrics`, `<run>.learner` and `<run>.drift` topics.

A `LiveTap` polls in a daemon thread, so the page never blocks on the broker; it reconnects after
any failure (broker down or restarted, topics missing) and reports its state as one line of text.
Rows are de-duplicated by content, so re-reading a topic from the start after a reconnect adds
nothing twice. `LiveTaps` holds this process's taps, at most `capacity` (least recently used stopped first).
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable

import msgspec
import pandas as pd

from dashboard.data import RunData
from streamer.runs import artifacts as art
from streamer.wire.schema import DriftEvent, LearnerEvent, MetricPoint

RETRY_S = 3.0  # after a failure
BOOTSTRAP_TIMEOUT_MS = 5000  # the Kafka client's first metadata (its default, 30 s, would pin a stopped thread)
RESYNC_S = 10.0  # quiet this long: re-read the topics from the start (doubling up to 5 min)
_TAPS: "weakref.WeakSet[LiveTap]" = weakref.WeakSet()


class BrokerUnreachable(ConnectionError):
    pass


def check_reachable(bootstrap: str, timeout: float = 2.0) -> None:
    """Fail within seconds when no bootstrap server accepts a TCP connection (a Kafka client
    retries for half a minute before it says so)."""
    errors = []
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout):
                return
        except (OSError, ValueError) as e:
            errors.append(f"{server.strip()}: {e}")
    raise BrokerUnreachable("; ".join(errors))


def kafka_consumer_factory(bootstrap: str, run: str):
    """A consumer of the run's three topics, from their start, with no group (read-only tap)."""
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.topics import Topics

    check_reachable(bootstrap)

    t = Topics(run)
    types = {t.metrics: MetricPoint, t.learner: LearnerEvent, t.drift: DriftEvent}
    # a bounded bootstrap: a stopped tap's thread ends within seconds even on a host that accepts but never answers
    return KafkaBus(bootstrap).consumer(types, group_id=None, bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS)


class LiveTap:
    def __init__(self, bootstrap: str, run: str, consumer_factory: Callable[[str, str], Any] | None = None,
                 retry_s: float = RETRY_S, resync_s: float = RESYNC_S):
        self.bootstrap, self.run, self.retry_s, self.resync_s = bootstrap, run, retry_s, resync_s
        self.factory = consumer_factory or kafka_consumer_factory
        self.lock = threading.Lock()
        self.rows: dict[str, list[dict]] = {"metrics": [], "learner": [], "drift": []}
        self.seen: set[bytes] = set()
        self._status = f"connecting to {bootstrap} for run '{run}'..."
        self.ok = False
        self.last_message: float | None = None  # monotonic time of the last message read
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"live-{run}", daemon=True)
        self.thread.start()
        _TAPS.add(self)

    def _loop(self) -> None:
        resync = self.resync_s
        while not self.stop_event.is_set():
            consumer = None
            try:
                consumer = self.factory(self.bootstrap, self.run)
                self._set_status(True, f"live: {self.bootstrap}, run '{self.run}'")
                quiet_since = time.monotonic()
                while not self.stop_event.is_set():
                    polled = consumer.poll(max_records=2000, timeout=0.5)
                    self._add(polled)
                    if polled:
                        quiet_since, resync = time.monotonic(), self.resync_s
                    elif time.monotonic() - quiet_since > resync:
                        # a restarted in-memory broker starts its offsets again at 0, below our
                        # positions, and may not say so: re-read from the start (rows de-duplicate),
                        # backing off while the run stays quiet
                        resync = min(resync * 2, 300.0)
                        break
                if not self.stop_event.is_set():
                    continue
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
            self.ok, self._status = ok, text

    @property
    def status(self) -> str:
        """One line for the page. A consumer does not fail while the broker is away, it just reads
        nothing: say how long it has been quiet."""
        with self.lock:
            text, ok, last = self._status, self.ok, self.last_message
        if ok:
            n = sum(len(v) for v in self.rows.values())
            quiet = time.monotonic() - last if last is not None else None
            text += f" · {n} messages"
            if quiet is not None and quiet > 30:
                text += f" · none for {quiet:.0f} s (run idle, or broker away)"
        return text

    def _add(self, polled) -> None:
        with self.lock:
            if polled:
                self.last_message = time.monotonic()
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

    def close(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        self.thread.join(timeout=timeout)


class ReadersBusy(RuntimeError):
    """Every live-reader slot is held by a thread still stopping (a client stuck on an unresponsive broker)."""


class LiveTaps:
    """One LiveTap per (bootstrap, run), at most `capacity` threads at once: asking for another stops the least
    recently used first (its thread joined for `join_s`). A thread that outlives its join (its Kafka client still
    bootstrapping) keeps its slot until it ends; while every slot is so held, `get` raises ReadersBusy."""

    def __init__(self, capacity: int, join_s: float = 2.0, **tap_options: Any) -> None:
        self.capacity, self.join_s, self.tap_options = capacity, join_s, tap_options
        self._taps: OrderedDict[tuple[str, str], LiveTap] = OrderedDict()
        self._stopping: list[LiveTap] = []
        self._lock = threading.Lock()

    def get(self, bootstrap: str, run: str) -> LiveTap:
        with self._lock:
            key = (bootstrap, run)
            tap = self._taps.pop(key, None)
            while self._taps and len(self._taps) + len(self._stopping) >= max(1, self.capacity):
                old = self._taps.popitem(last=False)[1]
                old.close(timeout=self.join_s)
                self._stopping.append(old)
                self._stopping = [t for t in self._stopping if t.thread.is_alive()]
            self._stopping = [t for t in self._stopping if t.thread.is_alive()]
            if tap is None and len(self._taps) + len(self._stopping) >= max(1, self.capacity):
                raise ReadersBusy(f"all {self.capacity} live readers are busy stopping (a broker that does not "
                                  f"answer); try again in a few seconds")
            self._taps[key] = tap or LiveTap(bootstrap, run, **self.tap_options)
            return self._taps[key]

    def threads(self) -> list[threading.Thread]:
        """The threads this holds that are alive (the current taps' and those still stopping)."""
        with self._lock:
            return [t.thread for t in [*self._taps.values(), *self._stopping] if t.thread.is_alive()]

    def __len__(self) -> int:
        return len(self._taps)

    def close(self) -> None:
        with self._lock:
            taps = [*self._taps.values(), *self._stopping]
            self._taps.clear()
            self._stopping = _close_together(taps)


_SHARED = LiveTaps(4)  # the server's: every session's page asks this one


def shared_taps(capacity: int) -> LiveTaps:
    """The server's taps (shared by every visitor), held to `capacity` (the `--max-live` setting)."""
    _SHARED.capacity = capacity
    return _SHARED


def close_all() -> None:
    """Stop every tap of this process (tests; the server's taps end with it)."""
    _SHARED.close()
    _close_together(list(_TAPS))


def _close_together(taps: list[LiveTap], timeout: float = 5.0) -> list[LiveTap]:
    """Stop every tap at once, then join each; returns those whose thread is still running."""
    for tap in taps:
        tap.stop_event.set()
    for tap in taps:
        tap.close(timeout=timeout)
    return [t for t in taps if t.thread.is_alive()]


def _reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, BrokerUnreachable) or type(e).__name__ == "NoBrokersAvailable" or "Unable to bootstrap" in text:
        return f"broker not reachable ({text})"
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

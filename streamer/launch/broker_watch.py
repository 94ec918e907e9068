"""`sao up` watches its broker: a run whose broker is gone stops at once, and says which broker and what was lost.

Without it the roles noticed one by one (a send is given up after the producer's delivery timeout, 120 s) and
`sao up` ended minutes later with "simulator exited 1", naming no broker. The embedded broker is a child process: its
exit is seen within one loop of `sao up` (0.5 s). Any broker, embedded or `--bootstrap`, is also asked for its
metadata every `interval_s` from a thread; no answer for `silence_s` (launch.broker_silence_s, 30 s) stops the run.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from streamer.transport.broker import EmbeddedBroker, metadata_error
from streamer.wire.settings import ClientSettings

# What the embedded broker's memory storage held, gone with its process.
MEMORY_LOST = ("lost with its memory storage: unconsumed tasks, trajectories not yet in a learner checkpoint, the "
               "consumer-group offsets, the dead-letter topic and the policy announcements; the learner's "
               "checkpoints and the run's files are kept, but a rerun with the same --run is refused by the learner "
               "(its checkpoint's offsets lie beyond the new broker's empty topics): start a new run (--run NAME)")
EXTERNAL_LOST = ("the roles were stopped; what the broker had not stored durably may be lost. Once it answers again, "
                 "rerun with the same --run: the learner resumes from its checkpoint, and refuses if the broker no "
                 "longer holds what that checkpoint read")


def answer_error(bootstrap: str, client: ClientSettings, timeout: float = 5.0) -> str | None:
    """None when one of the bootstrap brokers answers a Metadata request, else the last error. Plaintext brokers get
    a raw Metadata request; secured ones (SSL, SASL) a kafka-python admin client's, which authenticates first."""
    if client.security.kafka_python().get("security_protocol", "PLAINTEXT") == "PLAINTEXT":
        error = "no bootstrap address"
        for address in bootstrap.split(","):
            host, _, port = address.strip().rpartition(":")
            error = metadata_error(host.strip("[]"), int(port), timeout)
            if error is None:
                return None
        return error
    try:
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), client_id=client.client_id,
                                 request_timeout_ms=int(timeout * 1000), **client.security.kafka_python())
        try:
            admin.describe_cluster()
        finally:
            admin.close()
    except Exception as e:  # any failure to get an answer is what this reports
        return f"{type(e).__name__}: {e}"
    return None


class BrokerWatch:
    """Start with the run's broker; `lost()` is None while it lives, else the run's `failed: ...` reason."""

    def __init__(self, bootstrap: str, broker: EmbeddedBroker | None, client: ClientSettings,
                 silence_s: float = 30.0, interval_s: float = 2.0) -> None:
        self.bootstrap, self.broker, self.client = bootstrap, broker, client
        self.silence_s, self.interval_s = silence_s, interval_s
        self.last_answer, self.last_error = time.monotonic(), ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask, name="broker-watch", daemon=True)
        if silence_s > 0:  # 0: only the embedded broker's exit is watched
            self._thread.start()

    def _ask(self) -> None:
        while not self._stop.is_set():
            error = answer_error(self.bootstrap, self.client, timeout=min(5.0, max(0.5, self.silence_s / 3)))
            if error is None:
                self.last_answer = time.monotonic()
            else:
                self.last_error = error
            self._stop.wait(self.interval_s)

    def lost(self) -> str | None:
        ended = self.broker.exited() if self.broker is not None else None
        if ended:
            log = _last_line(self.broker.log_path)
            return (f"failed: the embedded broker at {self.bootstrap} {ended}"
                    + (f" (its log {self.broker.log_path} ends: {log})" if log else "") + f"; {self._lost_text()}")
        silent = time.monotonic() - self.last_answer
        if self.silence_s > 0 and silent > self.silence_s:
            kind = "embedded broker" if self.broker is not None else "broker"
            return (f"failed: the {kind} at {self.bootstrap} answered no Metadata request for {silent:.0f} s "
                    f"(launch.broker_silence_s {self.silence_s:g}; last error: {self.last_error}); "
                    + self._lost_text())
        return None

    def _lost_text(self) -> str:
        return EXTERNAL_LOST if self.broker is None else MEMORY_LOST

    def close(self) -> None:
        self._stop.set()


def _last_line(path: str, max_bytes: int = 4096) -> str:
    try:
        with open(Path(path), "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            text = re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode(errors="replace"))  # Tansu's colours
            lines = [x for x in text.splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[-300:] if lines else ""

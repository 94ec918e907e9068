"""Policy propagation: a weight store of versioned safetensors checkpoints, and its announcements.

Layout: `<root>/v000003/{model.safetensors, policy.json, manifest.json, config.json, sao_tokenizer.json}`. The
learner calls `WeightStore.publish(...)` (written under a temporary name, every file and the directory fsynced, then
renamed and the store fsynced: `install`), then its `Announcer` sends the version, signed with the run's key
(`streamer.transport.signing`), to `<run>.policy`; each agent's `PolicyFollower` reads `<run>.policy` (every agent
reads every announcement: no consumer group), dead-letters those that do not verify and, between rollouts, loads the
newest version from its `WeightSource` after checking its sha256. Two sources, one setting (`weights_transport`):
the store itself (`WeightStore`, "directory": a path this host shares with the learner) or the learner's weight server
(`streamer.transport.weight_client.HttpWeightSource`, "http": pulled in verified chunks into memory, no file written;
`weight_server.py` serves the store). `manifest.json` lists a version's files with their sizes, sha256 and the
sha256 of each `chunk_bytes` chunk (`Manifest`), for the pull. A corrupt checkpoint is refused with a log line
naming it, and the agent keeps its weights; an unreadable one (a transient file-system or network error) is retried
with a backoff, `READ_RETRIES` times, before it is refused. Announced URIs are confined to the agent's own source:
a checkpoint is read only from `<root or server>/v000123` for version 123 (`announced_dir`), whatever directory or
host the message names.

A sharded version (the megatron learner: each rank writes its own part, `streamer.transport.weight_shards`) has,
instead of `model.safetensors`, the shards `model-00001-of-0000N.safetensors` ... and `model.safetensors.index.json`
(HF's sharded-checkpoint index: `{"metadata": {"total_size"}, "weight_map": {tensor: shard}}`), in the training
dtype. Its manifest lists them first and names them, in that order, in `weights` (empty for a single file); its
announced sha256 is `weights_digest` of those entries: the sha256 of the sha256sum lines `"<sha256>  <name>\n"`, in
order. A reader checks the manifest against the announcement, then each file against its manifest entry, then merges
the shards into one state dict (a tensor in two shards, or not where the index says, is refused).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import msgspec

from streamer.transport.bus import Consumer
from streamer.transport.signing import Announcer, announce, resolved_key, verified  # noqa: F401 (re-exported)
from streamer.wire.schema import PolicyVersion, encode_json

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "model.safetensors.index.json"  # a sharded version's tensor -> shard map
CHUNK_BYTES = 4 * 1024 * 1024  # the manifest's default chunk size (the learner's io.weights_chunk_bytes)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # never copied as side files: the version has its own


def side_files(directory: str | Path) -> list[Path]:
    """A model directory's configuration and tokenizer files (config.json, tokenizer.json, sao_tokenizer.json, chat
    template, ...): every plain file but weights and policy.json."""
    return sorted(f for f in Path(directory).iterdir()
                  if f.is_file() and f.suffix not in WEIGHT_SUFFIXES
                  and f.name not in ("policy.json", MANIFEST_FILE, WEIGHTS_FILE)
                  and not f.name.endswith(".index.json"))


READ_RETRIES = 5  # an unreadable version is tried this many times (backoff 1, 2, 4, 8 s) before it is refused


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded (its bytes do not match the announced sha256, or it cannot be read:
    `transient`, worth trying again)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


class ManifestFile(msgspec.Struct, frozen=True):
    name: str  # a plain file name inside the version directory
    size: int  # bytes
    sha256: str  # of the whole file
    chunks: list[str]  # sha256 of each chunk: bytes [i * chunk_bytes, (i + 1) * chunk_bytes)


class Manifest(msgspec.Struct, frozen=True):
    """A version's files, for a pull in verified chunks (`<version dir>/manifest.json`)."""

    version: int
    step: int
    sha256: str  # the weights file's, as announced (sharded: `weights_digest` of the `weights` entries)
    chunk_bytes: int
    files: list[ManifestFile]  # the weights file (or shards, then index) first, then config and tokenizer files
    weights: list[str] = []  # sharded: the shards in order, then the index; empty for a single `model.safetensors`

    def file(self, name: str) -> ManifestFile | None:
        return next((f for f in self.files if f.name == name), None)


def shard_name(index: int, count: int) -> str:
    """The file of shard `index` (0-based) of `count`: model-00001-of-00004.safetensors, as HF names them."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def weights_digest(entries: list[ManifestFile]) -> str:
    """A sharded version's announced sha256: over "<sha256>  <name>\\n" of each entry, in the manifest's order."""
    return sha256_bytes("".join(f"{e.sha256}  {e.name}\n" for e in entries).encode())


def sharded_entries(manifest: Manifest, pv: PolicyVersion, what: str) -> list[ManifestFile]:
    """The manifest's `weights` entries (shards in order, then the index), checked against the announcement."""
    names = manifest.weights
    count = len(names) - 1
    if (manifest.version != pv.version or count < 1 or names[-1] != INDEX_FILE
            or names[:-1] != [shard_name(i, count) for i in range(count)]):
        raise CheckpointError(f"{what}: the manifest is for v{manifest.version} with weights {names[:4]}...: refused")
    entries = [manifest.file(n) for n in names]
    if any(e is None for e in entries):
        raise CheckpointError(f"{what}: the manifest names weights it does not list: refused")
    digest = weights_digest(entries)
    if digest != pv.sha256 or manifest.sha256 != pv.sha256:
        raise CheckpointError(f"{what}: the manifest's shards digest to {digest[:12]}..., announced "
                              f"{pv.sha256[:12]}...: refused")
    return entries


def merge_shards(index: bytes, shards: Any, what: str) -> dict[str, Any]:
    """One state dict from a sharded version's verified index bytes and its verified (name, bytes) shards, each
    loaded as it comes (an iterator keeps one shard's bytes at a time)."""
    from safetensors.torch import load

    try:
        weight_map = json.loads(index)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: {INDEX_FILE} is not an index: {e}") from None
    state: dict[str, Any] = {}
    for name, data in shards:
        try:
            part = load(data)
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{what}: {name} is not valid safetensors: {e}") from None
        for key, t in part.items():
            if key in state or weight_map.get(key) != name:
                raise CheckpointError(f"{what}: tensor {key} found in {name}, the index says "
                                      f"{weight_map.get(key)}{' (and twice)' if key in state else ''}: refused")
            state[key] = t
    if len(state) != len(weight_map):
        raise CheckpointError(f"{what}: the index lists {len(weight_map)} tensors, the shards hold {len(state)}")
    return state


def _read(file: Path, what: str) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{what}: checkpoint {file} unreadable: {e}", transient=True) from None


def _checked(file: Path, sha256: str, what: str, against: str = "announced") -> bytes:
    data = _read(file, what)
    digest = sha256_bytes(data)
    if digest != sha256:
        raise CheckpointError(f"{what}: {file} has sha256 {digest[:12]}..., {against} {sha256[:12]}...: refused")
    return data


def load_sharded(directory: Path, pv: PolicyVersion) -> dict[str, Any]:
    """The verified state dict of the sharded version in `directory` (manifest against the announcement, each file
    against the manifest)."""
    what = f"policy v{pv.version}"
    try:
        manifest = msgspec.json.decode(_read(directory / MANIFEST_FILE, what), type=Manifest)
    except msgspec.DecodeError as e:
        raise CheckpointError(f"{what}: {directory / MANIFEST_FILE} is not a manifest: {e}") from None
    *shards, index = sharded_entries(manifest, pv, what)
    return merge_shards(_checked(directory / INDEX_FILE, index.sha256, what, "its manifest"),
                        ((e.name, _checked(directory / e.name, e.sha256, what, "its manifest")) for e in shards), what)


def load_version_dir(directory: Path, pv: PolicyVersion) -> dict[str, Any]:
    """The verified state dict of version `pv` in `directory`: sharded if it has an index, else `model.safetensors`
    with the announced sha256."""
    from safetensors.torch import load

    if (directory / INDEX_FILE).is_file():
        return load_sharded(directory, pv)
    data = _checked(directory / WEIGHTS_FILE, pv.sha256, f"policy v{pv.version}")
    try:
        return load(data)
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"policy v{pv.version}: {directory} is not valid safetensors: {e}") from None


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def manifest_entry(name: str, data: bytes, chunk_bytes: int) -> ManifestFile:
    view = memoryview(data)
    chunks = [sha256_bytes(view[i:i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]
    return ManifestFile(name=name, size=len(data), sha256=sha256_bytes(data), chunks=chunks)


def _unshared(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop tensors that share storage with an earlier one (tied lm_head): safetensors refuses shared memory."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, t in state_dict.items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = t.detach().to("cpu").contiguous()
    return out


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to the disk (a directory: the names in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install(tmp: Path, final: Path, manifest: Manifest, pv: PolicyVersion) -> PolicyVersion:
    """Seal the version in `tmp` (manifest, policy.json) and rename it to `final`: every file fsynced, then `tmp`,
    then the store's directory after the rename (a power cut leaves the whole version or none of it)."""
    (tmp / MANIFEST_FILE).write_bytes(msgspec.json.encode(manifest))
    (tmp / "policy.json").write_bytes(encode_json(pv))
    for path in [*sorted(p for p in tmp.iterdir() if p.is_file()), tmp]:
        fsync_path(path)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(final.parent)
    return pv


class WeightStore:
    """A directory of versioned checkpoints (any shared path works for several machines). `chunk_bytes`: the
    manifest's chunk size; `base_uri`: announce `<base_uri>/v000123` (a weight server) instead of the path."""

    def __init__(self, root: str | Path, chunk_bytes: int = CHUNK_BYTES, base_uri: str = "") -> None:
        self.root = Path(root)
        self.chunk_bytes, self.base_uri = chunk_bytes, base_uri.rstrip("/")

    def path_of(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def publish(self, source: dict[str, Any] | str | Path, version: int, step: int,
                side_files_from: str | Path | None = None) -> PolicyVersion:
        """Write version `version` from a state dict or an HF model directory; returns its announcement.

        Written to a temporary directory and renamed, so readers never see half a checkpoint."""
        from safetensors.torch import save

        final = self.path_of(version)
        tmp = self.root / f".{final.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if isinstance(source, (str, Path)):
            data = (Path(source) / WEIGHTS_FILE).read_bytes()
            side_files_from = side_files_from or source
        else:
            data = save(_unshared(source))
        (tmp / WEIGHTS_FILE).write_bytes(data)
        entries = [manifest_entry(WEIGHTS_FILE, data, self.chunk_bytes)]
        for src in side_files(side_files_from) if side_files_from else ():
            shutil.copyfile(src, tmp / src.name)
            entries.append(manifest_entry(src.name, (tmp / src.name).read_bytes(), self.chunk_bytes))
        uri = f"{self.base_uri}/{final.name}" if self.base_uri else str(final.resolve())
        pv = PolicyVersion(version=version, uri=uri, sha256=entries[0].sha256, step=step, created_at=time.time())
        manifest = Manifest(version=version, step=step, sha256=pv.sha256, chunk_bytes=self.chunk_bytes, files=entries)
        return install(tmp, final, manifest, pv)

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` versions (0 keeps all); returns the versions deleted. An agent
        that asks for a deleted version later gets a CheckpointError and keeps its weights."""
        found = sorted(int(d.name[1:]) for d in self.root.glob("v[0-9]*") if d.name[1:].isdigit())
        gone = found[:-keep] if keep > 0 else []
        for v in gone:
            shutil.rmtree(self.path_of(v), ignore_errors=True)
        return gone

    def versions(self) -> list[PolicyVersion]:
        out = []
        for d in sorted(self.root.glob("v[0-9]*")):
            try:
                out.append(msgspec.json.decode((d / "policy.json").read_bytes(), type=PolicyVersion))
            except (OSError, msgspec.DecodeError) as e:
                log.warning("weight store: %s skipped (%s)", d, e)
        return out

    def latest(self) -> PolicyVersion | None:
        found = self.versions()
        return max(found, key=lambda pv: pv.version) if found else None

    def resolve(self, pv: PolicyVersion) -> Path:
        """The checkpoint directory: the announced uri's last part inside this store (the learner may see the
        store under another path; a uri elsewhere on disk is never read), which must be the version's own."""
        return self.root / announced_dir(pv)

    def read_verified(self, pv: PolicyVersion) -> bytes:
        """The bytes of a single-file version's `model.safetensors`, checked against the announced sha256."""
        return _checked(self.resolve(pv) / WEIGHTS_FILE, pv.sha256, f"policy v{pv.version}")

    def load(self, pv: PolicyVersion) -> dict[str, Any]:
        """The verified state dict of `pv` (hash checked on the very bytes that are loaded; a sharded version's
        shards merged)."""
        return load_version_dir(self.resolve(pv), pv)


def announced_dir(pv: PolicyVersion) -> str:
    """The version directory an announcement names (its uri's last part): `v000123` for version 123, else refused
    (an announcement of v10^15 pointing at an older version's files would load it under that number)."""
    name = pv.uri.removeprefix("file://").rstrip("/").rpartition("/")[2]
    if name != version_dir_name(pv.version):
        raise CheckpointError(f"policy v{pv.version}: announced uri {pv.uri!r} does not end in a version directory, "
                              f"its own ({version_dir_name(pv.version)}): refused")
    return name


class WeightSource(Protocol):
    """Where a follower reads announced versions: `WeightStore` (directory) or `HttpWeightSource` (http)."""

    def load(self, pv: PolicyVersion) -> dict[str, Any]:
        """The verified state dict of `pv`; CheckpointError (`transient` if worth another try) otherwise."""
        ...

    def latest(self) -> PolicyVersion | None: ...


class PolicyFollower:
    """Agent side: tracks announcements and swaps an engine's weights to the newest verified version, read from
    its `source` (the same logic for every transport). An announcement whose signature does not verify with `key`
    (default: the run's, `streamer.transport.signing.policy_key`) is dead-lettered and counts for nothing; of the
    others, the newest version not refused is loaded, so a refused one never hides the versions after it."""

    def __init__(self, consumer: Consumer, source: WeightSource, version: int = 0, key: bytes | None = None) -> None:
        self.consumer, self.source = consumer, source
        self.key = resolved_key(key, "policy follower")
        self.version = version  # the version the engine runs
        self.newest: PolicyVersion | None = None  # the newest verified announcement seen
        self.announced: dict[int, PolicyVersion] = {}  # verified announcements above `version`: the candidates
        self.refused: dict[int, str] = {}  # version -> why (for good)
        self.failed: dict[int, tuple[int, float, str]] = {}  # version -> (attempts, retry at, why): transient
        self.swaps = 0
        self.swapped_at = 0.0  # wall-clock time of the last swap

    def poll(self, timeout: float = 0.0) -> PolicyVersion | None:
        """The newest verified announced version above the current one, not refused and not waiting for a retry."""
        for msg in verified(self.consumer, self.key, timeout):
            if msg.version > self.version:
                self.announced[msg.version] = msg
            if self.newest is None or msg.version > self.newest.version:
                self.newest = msg
        now = time.monotonic()
        ready = [v for v in self.announced if v not in self.refused and now >= self.failed.get(v, (0, 0.0, ""))[1]]
        return self.announced[max(ready)] if ready else None

    def pace_version(self, engine_version: int) -> int:
        """The version an agent paces its admission on: the engine's, or the newer ones refused for good that follow
        it one by one (waiting for them would stall the agent and, with it, a learner that waits for trajectories).
        The learner numbers its versions one by one, so a refused version further ahead (a forged or broken
        announcement) moves nothing: only a loaded version does."""
        pace = engine_version
        while pace + 1 in self.refused:
            pace += 1
        return pace

    def maybe_swap(self, engine: Any, timeout: float = 0.0) -> bool:
        """Load the newest announced version into `engine` (`load_state_dict(sd, version)`); False if none."""
        pv = self.poll(timeout)
        if pv is None:
            return False
        try:
            state = self.source.load(pv)
            engine.load_state_dict(state, pv.version)
        except (CheckpointError, ValueError) as e:
            attempts = self.failed.get(pv.version, (0, 0.0, ""))[0] + 1
            if getattr(e, "transient", False) and attempts < READ_RETRIES:
                self.failed[pv.version] = (attempts, time.monotonic() + 2 ** (attempts - 1), str(e))
                log.warning("policy v%d unreadable (attempt %d of %d), keeping v%d: %s", pv.version, attempts,
                            READ_RETRIES, self.version, e)
                return False
            self.refused[pv.version] = str(e)
            log.error("policy v%d REFUSED, keeping v%d: %s", pv.version, self.version, e)
            return False
        log.info("policy v%d loaded from %s (sha256 %s, step %d, %.2f s after its announcement)", pv.version,
                 getattr(self.source, "last_from", None) or getattr(self.source, "url", None)
                 or getattr(self.source, "root", "?"), pv.sha256, pv.step, time.time() - pv.created_at)
        self.version = pv.version
        self.announced = {v: a for v, a in self.announced.items() if v > self.version}
        self.swaps += 1
        self.swapped_at = time.time()
        return True

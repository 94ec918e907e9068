"""The broadcast weight transport's shared parts: the rendezvous keys, the group record, buckets, the digest.

"broadcast" (`launch.weights_transport`) sends each policy version from the learner's rank 0 to the agents over a
torch.distributed process group of its own (gloo on CPU, NCCL when the weights are on a GPU), as slime, AReaL,
PipelineRL and verl do. The learner side is `weight_broadcast.Broadcaster`, the agent side
`weight_receiver.BroadcastWeightSource`; the weight server (`weight_server.py`) runs beside it for agents that are
not in the group (late, restarted, or after a failed transfer: they pull the version over HTTP).

Rendezvous: a `torch.distributed.TCPStore` on the learner (`io.weights_group_bind`; agents: `weights_group`). Keys:

    joins                      a counter: an agent that wants in takes a ticket (add 1) ...
    join/<ticket>              ... and writes its member id there (host-pid-nonce: a restarted agent is a new member)
    gen                        the current `GroupRecord` (JSON): epoch, generation, backend, timeout, members, the
                               tickets taken so far (an agent it does not list and whose ticket it took asks again),
                               the newest version offered before it (the group sends only later ones)
    <group>/ack/<member>       a listed member is there and ready (`<group>`: g/<epoch>/<generation>)
    <group>/go                 every listed member acked: build the process group (its own keys: <group>/pg/)
    <group>/v/<k>              the k-th version sent in this group: its `Header` (JSON), then its buckets follow

A version travels as `Header` + buckets: its tensors, in name order, packed as raw bytes into flat uint8 buffers of at
most `bucket_bytes` (a tensor larger than that gets a bucket of its own), at offsets aligned to 16 bytes, one
broadcast per bucket. The bytes are the model's own: a bf16 model is sent as bf16 (2 bytes a parameter), never
upcast. The receiver views each tensor back out of its bucket (no copy) and checks the digest.

Digest (`tensors_digest`): sha256 over the tensors in name order, each as the UTF-8 text `name NUL dtype NUL shape
NUL` (dtype as torch names it, `torch.bfloat16`; shape as comma-separated sizes) followed by its bytes in memory
order (little-endian). The learner computes it from the packed buffers and announces it on `<run>.policy`
(`PolicyVersion.tensors_sha256`) beside the file's sha256; the agent computes it again over what it received.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import msgspec
import torch

from streamer.transport.weights import CheckpointError

ALIGN = 16  # bytes: every tensor starts at a multiple of this in its bucket (any dtype can be viewed out of it)
BUCKET_BYTES = 64 * 1024 * 1024  # the learner's io.weights_bucket_bytes default
DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                              torch.int16, torch.int8, torch.uint8, torch.bool)}
JOINS = "joins"
GEN = "gen"


class GroupRecord(msgspec.Struct, frozen=True):
    """The learner's current group (`gen` key): who is in it, and how to build it."""

    epoch: str  # this learner process's (a restarted learner starts at generation 1 again)
    gen: int
    backend: str  # gloo | nccl
    timeout_s: float  # every operation of the group (building it, each bucket)
    members: list[str]  # rank i + 1 is members[i]; the learner is rank 0
    joined: int  # tickets taken up to this one
    after: int = -1  # versions up to this one were offered before the group: it sends none of them (pull those)

    @property
    def prefix(self) -> str:
        return f"g/{self.epoch}/{self.gen}/"


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str  # a key of DTYPES
    shape: list[int]
    bucket: int
    offset: int  # bytes into its bucket
    nbytes: int


class Header(msgspec.Struct, frozen=True):
    """What precedes a version's buckets: the receiver allocates the buckets and views the tensors out of them."""

    version: int
    step: int
    digest: str  # tensors_digest of the tensors
    buckets: list[int]  # each bucket's size in bytes
    tensors: list[TensorSpec]  # in name order


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view when it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def tensors_digest(items: Iterable[tuple[str, str, list[int], torch.Tensor]]) -> str:
    """sha256 of (name, dtype, shape, raw uint8 bytes) tuples, given in name order (see the module's docstring)."""
    h = hashlib.sha256()
    for name, dtype, shape, raw in items:
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode())
        if raw.numel():
            h.update(raw.cpu().numpy().data)
    return h.hexdigest()


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """tensors_digest of a state dict (what a test or a user compares with an announcement)."""
    return tensors_digest((n, str(t.dtype), list(t.shape), _raw(t)) for n, t in sorted(state.items()))


def plan(state: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[int], list[TensorSpec]]:
    """Bucket sizes and where each tensor (name order) goes: greedy, a new bucket when the next would overflow."""
    sizes: list[int] = []
    specs, used = [], bucket_bytes  # forces a first bucket
    for name in sorted(state):
        t = state[name]
        if str(t.dtype) not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not sent by broadcast ({', '.join(DTYPES)})")
        n = t.numel() * t.element_size()
        offset = -(-used // ALIGN) * ALIGN
        if sizes and offset + n <= bucket_bytes:
            sizes[-1] = offset + n
        else:
            sizes.append(n)
            offset = 0
        used = offset + n
        specs.append(TensorSpec(name, str(t.dtype), list(t.shape), len(sizes) - 1, offset, n))
    return sizes, specs


class Packed(NamedTuple):
    header: Header
    buffers: list[torch.Tensor]  # uint8, one per bucket


def pack(state: dict[str, torch.Tensor], version: int, step: int, bucket_bytes: int = BUCKET_BYTES) -> Packed:
    """A copy of `state` in buckets (on its tensors' device), with its digest: the learner may go on training."""
    device = next(iter(state.values())).device if state else torch.device("cpu")
    sizes, specs = plan(state, bucket_bytes)
    buffers = [torch.empty(max(size, 1), dtype=torch.uint8, device=device) for size in sizes]
    for spec in specs:
        dst, src = buffers[spec.bucket][spec.offset:spec.offset + spec.nbytes], _raw(state[spec.name].to(device))
        if device.type == "cpu" and spec.nbytes:  # numpy's memcpy: torch's copy spins its thread pool up for this
            dst.numpy()[:] = src.numpy()
        else:
            dst.copy_(src)
    digest = tensors_digest((s.name, s.dtype, s.shape, buffers[s.bucket][s.offset:s.offset + s.nbytes])
                            for s in specs)
    return Packed(Header(version, step, digest, sizes, specs), buffers)


def unpack(header: Header, buffers: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) viewed out of received buckets, no copy."""
    for s in header.tensors:
        raw = buffers[s.bucket][s.offset:s.offset + s.nbytes]
        yield s.name, raw.view(DTYPES[s.dtype]).reshape(s.shape)


def check_header(header: Header) -> None:
    """CheckpointError unless the header describes tensors inside its buckets, in dtypes we know."""
    for s in header.tensors:
        if s.dtype not in DTYPES or not 0 <= s.bucket < len(header.buckets) or s.offset % ALIGN or s.offset < 0 \
                or s.offset + s.nbytes > header.buckets[s.bucket] \
                or s.nbytes != DTYPES[s.dtype].itemsize * _numel(s.shape):
            raise CheckpointError(f"policy v{header.version}: broadcast header entry {s} is malformed: refused")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def received_state(header: Header, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict in received buckets, its digest checked against the header's (CheckpointError otherwise)."""
    digest = tensors_digest((s.name, s.dtype, s.shape, buffers[s.bucket][s.offset:s.offset + s.nbytes])
                            for s in header.tensors)
    if digest != header.digest:
        raise CheckpointError(f"policy v{header.version}: received tensors have digest {digest[:12]}..., the "
                              f"learner's {header.digest[:12]}...: refused")
    return dict(unpack(header, buffers))


def make_group(store: Any, rank: int, size: int, backend: str, timeout_s: float, loopback: bool) -> Any:
    """A process group of its own (no default group needed, none touched): gloo, or NCCL for GPU buffers."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # on one host, loopback; across hosts, the interface GLOO_SOCKET_IFNAME names (else this host name's address)
    device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback \
        else dist.ProcessGroupGloo.create_default_device()
    opts._devices = [device]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def broadcast_buckets(pg: Any, buffers: list[torch.Tensor], done: Callable[[int], None] | None = None) -> None:
    """Every bucket from rank 0, posted at once (the backend pipelines them), then waited for in order (`done(i)`
    after bucket i)."""
    import torch.distributed as dist

    works = []
    for buf in buffers:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        works.append(pg.broadcast([buf], opts))
    for i, work in enumerate(works):
        work.wait()
        if done is not None:
            done(i)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def record_of(raw: bytes) -> GroupRecord:
    return msgspec.json.decode(raw, type=GroupRecord)

"""The learner's side of the broadcast weight transport: rank 0 sends each version to the agents of its group.

`Broadcaster(bind, bucket_bytes, timeout_s).start()` hosts the rendezvous store (`weight_group`'s keys; a
`TCPStore` listening on `bind`'s port) and one sender thread. The publisher calls `offer(state, pv)` on the training
thread once the version is in the weight store and before announcing it: the weights are copied into buckets and
their digest computed (`weight_group.pack`), the copy goes to the sender, and the announcement comes back with
`tensors_sha256` set. Nothing there waits on an agent. The sender holds only the newest version: one offered
while an older one waits replaces it (counted in `skipped`; the agents pull the skipped one if they want it).

Before each send, and every `IDLE_S` between sends, the sender takes the agents that asked to join (tickets in the
store). With new ones, or no group, it forms a new generation: it lists the members (those of the current group
first, then the new ones) in the `gen` record, waits for each to ack (`ACK_S` at most; the silent ones are left out
and the rest asked again), says go, and builds the process group (gloo, or NCCL for weights on a GPU) with them.
Any failure (a member dead, or stalled past `timeout_s`; a member that did not build the group) dissolves it: a
record with no members, which tells every agent to ask again; the next version (or the next idle look) forms a new
group from those that do. The agents left out meanwhile pull versions over HTTP from the weight server that runs
beside (`learner/train.py` starts both). The TCPStore listens on every interface at its port, and takes no
credentials: like the weight server, it belongs on a private network.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time
from typing import Any

import msgspec

from streamer.transport.weight_group import (
    BUCKET_BYTES,
    GEN,
    JOINS,
    GroupRecord,
    Packed,
    broadcast_buckets,
    is_loopback,
    make_group,
    pack,
)
from streamer.wire.config import ConfigError
from streamer.wire.schema import PolicyVersion
from streamer.wire.settings import parse_hostport

log = logging.getLogger(__name__)

ACK_S = 5.0  # a listed agent acks within this (agents look at the record every POLL_S)
POLL_S = 0.05
IDLE_S = 0.5  # between versions, the sender looks for agents that asked to join this often (and takes them in)


def distinct(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict less tensors sharing storage with an earlier one (a tied lm_head), as the weight store
    writes it (the same names either way); tensors stay where they are (a GPU's stay there, for NCCL)."""
    seen, out = set(), {}
    for name, t in state.items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ptr not in seen:
            seen.add(ptr)
            out[name] = t.detach()
    return out


class Broadcaster:
    """`offer` on the training thread; `close()` at the end. `stats()`: versions sent, skipped, failed, groups."""

    def __init__(self, bind: str = "127.0.0.1:0", bucket_bytes: int = BUCKET_BYTES, timeout_s: float = 30.0,
                 where: str = "weights_group_bind") -> None:
        import torch.distributed as dist

        host, port = parse_hostport(bind, where)
        try:
            self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise ConfigError(f"{where}: cannot listen on {bind}: {e}") from None
        self.host, self.loopback = host, is_loopback(host)
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.epoch, self.gen, self.joined = secrets.token_hex(4), 0, 0
        self.record: GroupRecord | None = None
        self.pg: Any = None
        self.members: list[str] = []
        self.sent_in_group = 0
        self.backend = "gloo"  # nccl once a version comes from GPU tensors
        self.offered = -1  # the newest version offered
        self.counts = {"offered": 0, "sent": 0, "skipped": 0, "failed": 0, "groups": 0, "no_members": 0}
        self.last_send_s = 0.0
        self._job: tuple[Packed, str] | None = None
        self._closing = self._busy = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="weight-broadcast", daemon=True)
        self._set_record("gloo", [])  # generation 0: agents learn the epoch and ask to join

    @property
    def address(self) -> str:
        """HOST:PORT of the rendezvous store (the port it got when bound to 0)."""
        return f"{self.host}:{self.store.port}"

    def start(self) -> Broadcaster:
        self._thread.start()
        log.info("weight broadcast: rendezvous on %s, buckets of %.0f MiB, timeout %.0f s", self.address,
                 self.bucket_bytes / 2**20, self.timeout_s)
        return self

    def offer(self, state: dict[str, Any], pv: PolicyVersion) -> PolicyVersion:
        """Hand version `pv` (its weights: `state`, copied here) to the sender; `pv` with its tensors' digest."""
        packed = pack(distinct(state), pv.version, pv.step, self.bucket_bytes)
        backend = "nccl" if packed.buffers and packed.buffers[0].is_cuda else "gloo"
        with self._cv:
            self.backend, self.offered = backend, pv.version
            self.counts["offered"] += 1
            if self._job is not None:
                self.counts["skipped"] += 1
            self._job = (packed, backend)
            self._cv.notify()
        return msgspec.structs.replace(pv, tensors_sha256=packed.header.digest)

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "members": list(self.members), "generation": self.gen, "last_send_s": self.last_send_s}

    def idle(self) -> bool:
        """Nothing waiting to be sent and nothing being sent (for tests and benchmarks)."""
        with self._cv:
            return self._job is None and not self._busy

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._job is None and not self._closing:
                    self._cv.wait(IDLE_S)
                if self._closing:
                    return
                job, self._job = self._job, None
                self._busy = True
            try:
                if job is not None:
                    self._send(*job)
                elif self.store.add(JOINS, 0) > self.joined:  # idle, and an agent asked: take it in now
                    self._ensure_group(self.backend, self.offered)
            except Exception as e:  # a member dead, stalled or gone: dissolve; the next version re-forms the group
                self.counts["failed"] += 1
                what = f"policy v{job[0].header.version} not sent" if job else "no group formed"
                log.warning("weight broadcast: %s (members %s): %s: %s; group dissolved (they pull versions over "
                            "HTTP, and ask to join again)", what, self.members, type(e).__name__,
                            str(e).splitlines()[0][:300] if str(e) else "")
                self._dissolve()
            finally:
                with self._cv:
                    self._busy = False

    def _send(self, packed: Packed, backend: str) -> None:
        if not self._ensure_group(backend, packed.header.version - 1):
            self.counts["no_members"] += 1
            return
        t0 = time.monotonic()
        prefix = self.record.prefix
        self.store.set(f"{prefix}v/{self.sent_in_group}", msgspec.json.encode(packed.header))
        if self.sent_in_group:
            self.store.delete_key(f"{prefix}v/{self.sent_in_group - 1}")
        self.sent_in_group += 1
        broadcast_buckets(self.pg, packed.buffers)
        self.last_send_s = time.monotonic() - t0
        self.counts["sent"] += 1
        log.info("weight broadcast: policy v%d to %d agents in %.2f s (%d buckets, %.1f MiB)",
                 packed.header.version, len(self.members), self.last_send_s, len(packed.buffers),
                 sum(packed.header.buckets) / 2**20)

    def _take_joins(self) -> list[str]:
        """Member ids of the tickets taken since the last call (a ticket whose id is not written yet waits)."""
        count, ids = self.store.add(JOINS, 0), []
        while self.joined < count:
            key = f"join/{self.joined + 1}"
            if not self.store.check([key]):
                break
            ids.append(self.store.get(key).decode())
            self.store.delete_key(key)
            self.joined += 1
        return ids

    def _ensure_group(self, backend: str, after: int) -> bool:
        """A group with every agent that asked (new ones taken in), to send versions above `after`; False when
        there is none to send to."""
        joiners = self._take_joins()
        if self.pg is not None and not joiners and self.record.backend == backend:
            return True
        members = list(dict.fromkeys([*(self.members if self.pg is not None else []), *joiners]))
        self._drop_group()
        for _ in range(3):
            if not members:
                break
            self._set_record(backend, members, after)
            acked = self._await_acks(members)
            if acked == members:
                prefix = self.record.prefix
                self.store.set(f"{prefix}go", b"1")
                import torch.distributed as dist

                self.pg = make_group(dist.PrefixStore(f"{prefix}pg/", self.store), 0, len(members) + 1, backend,
                                     self.timeout_s, self.loopback)
                self.members, self.sent_in_group = members, 0
                self.counts["groups"] += 1
                log.info("weight broadcast: generation %d, %s group of the learner and %d agents: %s", self.gen,
                         backend, len(members), members)
                return True
            log.warning("weight broadcast: %s did not answer in %.0f s: left out", sorted(set(members) - set(acked)),
                        ACK_S)
            members = acked
        self._set_record(backend, [])
        return False

    def _await_acks(self, members: list[str]) -> list[str]:
        prefix, deadline = self.record.prefix, time.monotonic() + min(ACK_S, self.timeout_s)
        while True:
            acked = [m for m in members if self.store.check([f"{prefix}ack/{m}"])]
            if len(acked) == len(members) or time.monotonic() > deadline:
                return acked
            time.sleep(POLL_S)

    def _set_record(self, backend: str, members: list[str], after: int = -1) -> None:
        self.gen += 1
        self.record = GroupRecord(self.epoch, self.gen, backend, self.timeout_s, members, self.joined, after)
        self.store.set(GEN, msgspec.json.encode(self.record))

    def _drop_group(self) -> None:
        self.pg, self.members = None, []

    def _dissolve(self) -> None:
        self._drop_group()
        try:
            self._set_record(self.record.backend if self.record else "gloo", [])
        except RuntimeError as e:  # the store is ours: this is not expected, but must not kill the thread
            log.error("weight broadcast: cannot reset the group record: %s", e)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 5)
        self._drop_group()
        if not self._thread.is_alive():
            self.store = None  # the rendezvous server stops (agents connect again to the next learner)

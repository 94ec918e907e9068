"""The agent's side of the broadcast weight transport: receive versions in the learner's group, else pull them.

`BroadcastWeightSource(group, fallback, member_id)` is a `PolicyFollower` source. Its `Receiver` thread connects to
the learner's rendezvous store at `group` (HOST:PORT, `weights_group`), asks to join (a ticket), and when a
generation lists it, acks, waits for the go and builds the process group with the learner (rank 0) and the other
members; then it receives each version the learner sends (a `Header` under `<group>/v/<k>`, then the buckets) into
fresh buffers, checks the tensors' digest against the header's and keeps the newest two. A failed receive (the learner
or another member gone, a timeout) or a generation that no longer lists it: it leaves the group and asks to join
again; the learner takes it in at a later version. A lost connection to the store (a restarted learner): it
connects again. Nothing here stops the agent.

`load(pv)` returns the received version when its digest is the announced `tensors_sha256`. While the receiver is
in a group that has not sent `pv` yet, it waits for it (the group's timeout at most). Otherwise (not in a group, the
version skipped, a digest that differs) it pulls `pv` from `fallback` (the learner's weight server,
`HttpWeightSource`): an agent that joins late, restarted or saw a transfer fail keeps getting every version.
`last_from` names where the last one came from; `counts` how many came each way.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
import torch

from streamer.transport.weight_group import (
    GEN,
    JOINS,
    GroupRecord,
    Header,
    broadcast_buckets,
    check_header,
    is_loopback,
    make_group,
    received_state,
    record_of,
)
from streamer.transport.weights import WeightSource
from streamer.wire.schema import PolicyVersion
from streamer.wire.settings import parse_hostport

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often the receiver looks at the store
RETRY_S = 1.0  # after a lost connection to the store, before connecting again
KEEP = 2  # versions received and kept (an announcement read late finds its version though a newer one came)


class Receiver:
    """The agent's member of the learner's group, in a daemon thread (`start()`, `stop()`)."""

    def __init__(self, group: str, member_id: str, device: str = "cpu", connect_timeout_s: float = 10.0) -> None:
        self.host, self.port = parse_hostport(group, "weights_group")
        self.address, self.member_id, self.device = group, member_id, torch.device(device)
        self.connect_timeout_s = connect_timeout_s
        self.cv = threading.Condition()
        self.member = False  # in a built group now
        self.joining = False  # listed in a generation being formed
        self.after = -1  # the group sends only versions above this one
        self.timeout_s = 30.0  # the group's (from its record)
        self.newest = -1  # the newest version received whole
        self.kept: deque[tuple[Header, dict[str, torch.Tensor]]] = deque(maxlen=KEEP)  # the newest received
        self.progress: tuple[int, int, int] | None = None  # (version, buckets done, buckets) while receiving
        self.counts = {"received": 0, "failed": 0, "groups": 0, "joins": 0}
        self.pg: Any = None
        self.unable = ""  # why this agent cannot be a member (it then never asks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        atexit.register(self.stop)  # the group and the store let go of before the interpreter goes
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._leave()

    def wait_for(self, version: int) -> tuple[Header, dict[str, torch.Tensor]] | None:
        """Version `version` as received; None when it will not come by broadcast (not a member, or skipped)."""
        with self.cv:
            deadline = time.monotonic() + self.timeout_s
            while True:
                for got in self.kept:
                    if got[0].version == version:
                        return got
                left = deadline - time.monotonic()
                if not (self.member or self.joining) or version <= self.after or self.newest >= version or left <= 0:
                    return None
                self.cv.wait(min(left, 0.5))

    def _set_member(self, member: bool, joining: bool = False) -> None:
        with self.cv:
            self.member, self.joining = member, joining
            self.cv.notify_all()

    def _leave(self) -> None:
        self.pg = None
        self._set_member(False)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._session()
            except Exception as e:  # the store unreachable or gone (a learner restarting): try again
                self._leave()
                log.info("weight group %s: %s: %s; pulling over HTTP meanwhile", self.address, type(e).__name__,
                         str(e).splitlines()[0][:200] if str(e) else "")
                self._stop.wait(RETRY_S)

    def _session(self) -> None:
        import torch.distributed as dist

        store = dist.TCPStore(self.host, self.port, is_master=False,
                              timeout=datetime.timedelta(seconds=self.connect_timeout_s))
        current: GroupRecord | None = None
        ticket, next_k = 0, 0  # ticket 0: none taken in this epoch
        while not self._stop.is_set():
            rec = record_of(store.get(GEN)) if store.check([GEN]) else None
            if rec is not None and (current is None or (rec.epoch, rec.gen) != (current.epoch, current.gen)):
                if current is None or rec.epoch != current.epoch:
                    ticket = 0
                self._leave()
                current, next_k = rec, 0
                if self.member_id in rec.members and self._enter(store, rec):
                    continue
                if ticket <= rec.joined and not self.unable:  # not asked yet, or asked and left out: ask (again)
                    ticket = self._ask(store)
            elif self.pg is not None and store.check([f"{current.prefix}v/{next_k}"]):
                header = msgspec.json.decode(store.get(f"{current.prefix}v/{next_k}"), type=Header)
                next_k += 1
                if not self._receive(header):
                    ticket = self._ask(store)
                continue
            self._stop.wait(POLL_S)

    def _ask(self, store: Any) -> int:
        ticket = store.add(JOINS, 1)
        store.set(f"join/{ticket}", self.member_id)
        self.counts["joins"] += 1
        return ticket

    def _enter(self, store: Any, rec: GroupRecord) -> bool:
        """Ack generation `rec`, wait for its go, build the group; False if the learner moved on first."""
        import torch.distributed as dist

        if rec.backend == "nccl" and self.device.type != "cuda":
            self.unable = f"the learner sends from GPUs (NCCL) and this agent runs on {self.device}"
            log.warning("weight group %s: %s: it pulls every version over HTTP", self.address, self.unable)
            return False
        self.timeout_s, self.after = rec.timeout_s, rec.after
        self._set_member(False, joining=True)  # a version asked for meanwhile waits for the group
        built = False
        try:
            store.set(f"{rec.prefix}ack/{self.member_id}", b"1")
            deadline = time.monotonic() + rec.timeout_s
            while not store.check([f"{rec.prefix}go"]):
                if self._stop.is_set() or time.monotonic() > deadline or record_of(store.get(GEN)).gen != rec.gen:
                    return False
                time.sleep(POLL_S)
            self.pg = make_group(dist.PrefixStore(f"{rec.prefix}pg/", store), rec.members.index(self.member_id) + 1,
                                 len(rec.members) + 1, rec.backend, rec.timeout_s, is_loopback(self.host))
            built = True
        finally:
            self._set_member(built)
        self.counts["groups"] += 1
        log.info("weight group %s: generation %d, rank %d of %d", self.address, rec.gen,
                 rec.members.index(self.member_id) + 1, len(rec.members) + 1)
        return True

    def _receive(self, header: Header) -> bool:
        """Receive one version's buckets; False (and out of the group) if that failed."""
        try:
            check_header(header)
            buffers = [torch.empty(max(n, 1), dtype=torch.uint8, device=self.device) for n in header.buckets]
            self.progress = (header.version, 0, len(buffers))
            broadcast_buckets(self.pg, buffers, self._done)
            state = received_state(header, buffers)
        except Exception as e:  # the transfer failed (or its digest differs): leave, ask to join again
            self.counts["failed"] += 1
            log.warning("weight group %s: policy v%d not received: %s: %s; pulling over HTTP until the learner "
                        "takes this agent in again", self.address, header.version, type(e).__name__,
                        str(e).splitlines()[0][:300] if str(e) else "")
            self._leave()
            return False
        finally:
            self.progress = None
        self.counts["received"] += 1
        with self.cv:
            self.kept.append((header, state))
            self.newest = max(self.newest, header.version)
            self.cv.notify_all()
        return True

    def _done(self, i: int) -> None:
        if self.progress is not None:
            self.progress = (self.progress[0], i + 1, self.progress[2])


class BroadcastWeightSource:
    """A `PolicyFollower` source: versions received in the learner's group, else pulled from `fallback`."""

    def __init__(self, group: str, fallback: WeightSource, member_id: str, device: str = "cpu") -> None:
        self.fallback = fallback
        self.receiver = Receiver(group, member_id, device).start()
        self.group = group
        self.last_from = ""
        self.counts = {"broadcast": 0, "pulled": 0}

    def load(self, pv: PolicyVersion) -> dict[str, Any]:
        got = self.receiver.wait_for(pv.version)
        if got is not None:
            header, state = got
            if pv.tensors_sha256 and header.digest == pv.tensors_sha256:
                self.last_from = f"broadcast group {self.group}"
                self.counts["broadcast"] += 1
                return state
            log.error("policy v%d: received tensors have digest %s..., announced %s...: pulling it instead",
                      pv.version, header.digest[:12], pv.tensors_sha256[:12] or "(none)")
        state = self.fallback.load(pv)
        self.last_from = getattr(self.fallback, "url", None) or str(getattr(self.fallback, "root", "?"))
        self.counts["pulled"] += 1
        return state

    def latest(self) -> PolicyVersion | None:
        return self.fallback.latest()

    def close(self) -> None:
        self.receiver.stop()
        close = getattr(self.fallback, "close", None)
        if close is not None:
            close()

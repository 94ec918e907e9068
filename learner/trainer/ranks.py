"""The learner over several ranks (the megatron backend under torchrun): who reads, who trains what.

Rank 0 (the leader) alone reads the source, admits and batches trajectories, emits LearnerEvents,
publishes versions and commits offsets. Each step it broadcasts the batch to every rank as the
trajectories' msgspec JSON in a uint8 tensor (no pickle, one shape for gloo and NCCL). Every rank
then computes the advantages on the whole batch (no-grad forwards: identical on every rank, so
whitening and group estimators see the whole batch) and back-propagates through its own rows:

    rows of rank r (strided): r, r + W, r + 2W, ...; the batch is padded to a multiple of W rows with
    copies of its last row whose loss mask is zero, so every rank runs the same number of forward
    passes (expert parallelism's all-to-all is a collective: a rank with fewer would hang).

The objective is the global token (or sequence) mean: a micro-batch's loss is weighted by
W * its tokens / the whole batch's tokens, and the gradient all-reduce divides the sum over ranks
by W (learner.backends.megatron.grads). With tensor or pipeline parallelism the ranks of one model replica share
its rows: W and r are then the data-parallel size and rank (`RankGroup(dp=(rank, size))`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from streamer.transport import shared
from streamer.wire.reductions import reduction
from streamer.wire.schema import Trajectory, decode_json, encode_json


def shard_rows(n: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index into the batch, real) for `rank`: ceil(n / world) rows; padding repeats row n - 1."""
    per = -(-n // world)
    idx = torch.arange(per) * world + rank
    return idx.clamp(max=n - 1), idx < n


@dataclass
class Shard:
    """This rank's part of a batch, and how its metrics combine with the other ranks'."""

    index: torch.Tensor  # [b] long rows of the whole batch
    real: torch.Tensor  # [b] bool; False for padding rows (loss mask zeroed)
    world: int
    group: "RankGroup"

    def reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        return self.group.reduce_metrics(metrics)


class RankGroup:
    """Collectives the trainer needs, over the default torch.distributed group."""

    def __init__(self, device: torch.device | str = "cpu", dp: tuple[int, int] | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("RankGroup: torch.distributed is not initialised (launch with torchrun)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # (data-parallel rank, size): who shares rows; every rank of one replica (TP, PP) gets the same rows
        self.dp_rank, self.dp_world = dp if dp is not None else (self.rank, self.world)
        self.device = torch.device(device)  # NCCL moves device tensors only

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> Shard:
        idx, real = shard_rows(n, self.dp_rank, self.dp_world)
        return Shard(idx, real, self.dp_world, self)

    def barrier(self) -> None:
        dist.barrier()

    def share_int(self, x: int) -> int:
        """The leader's `x` on every rank."""
        t = torch.tensor([x if self.leader else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def share_text(self, text: str) -> str:
        """The leader's `text` on every rank (UTF-8 in a uint8 tensor)."""
        payload = text.encode() if self.leader else b""
        n = self.share_int(len(payload))
        if not n:
            return ""
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.leader
               else torch.empty(n, dtype=torch.uint8)).to(self.device)
        dist.broadcast(buf, src=0)
        return bytes(buf.cpu().numpy()).decode()

    def all_true(self, ok: bool) -> bool:
        """True on every rank when `ok` is true on every rank (a barrier that carries each rank's verdict)."""
        t = torch.tensor([int(bool(ok))], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def share_trajectories(self, trajs: list[Trajectory] | None) -> list[Trajectory] | None:
        """The leader's batch (None: stop) on every rank, as JSON lines in a uint8 tensor."""
        payload = b"\n".join(encode_json(t) for t in trajs) if self.leader and trajs is not None else b""
        n = self.share_int(len(payload) if self.leader and trajs is not None else -1)
        if n < 0:
            return None
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.leader
               else torch.empty(n, dtype=torch.uint8)).to(self.device)
        if n:
            dist.broadcast(buf, src=0)
        if self.leader:
            return trajs
        return [decode_json(line, Trajectory) for line in bytes(buf.cpu().numpy()).split(b"\n") if line]

    def reduce_metrics(self, m: dict[str, float]) -> dict[str, float]:
        """Per-rank weighted sums -> whole-batch values by each key's declared reduction
        (streamer.wire.reductions): means summed / W, sums summed, maxima maxed. Every rank must pass the same
        keys (the same loss function does). The world / W ranks of one replica report the same rows: sums are
        divided by that count."""
        copies = self.world // self.dp_world
        how = {k: reduction(f"learner/{k}") for k in sorted(m)}
        mx = [k for k, red in how.items() if red == "max"]
        rest = [k for k, red in how.items() if red != "max"]
        out: dict[str, float] = {}
        if rest:
            t = torch.tensor([m[k] for k in rest], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            out.update({k: float(v) / (copies if how[k] == "sum" else self.world) for k, v in zip(rest, t.tolist())})
        if mx:
            t = torch.tensor([m[k] for k in mx], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.update(zip(mx, t.tolist()))
        return out

    def check_shared(self, setting: str, path: str, fix: str) -> str:
        """"" when every rank sees one directory at `path` (each writes a marker file and looks for the others'),
        else the error; every rank gets the same answer (call it on every rank)."""
        token = f"{self.share_int(random.getrandbits(48)):012x}"
        names = [shared.marker(token, f"rank{r}") for r in range(self.world)]
        failed = shared.mark(path, names[self.rank])
        self.barrier()
        seen = torch.zeros(self.world, self.world + 1, dtype=torch.int64)  # row r: what rank r saw; last: no write
        missing = set(shared.unseen(path, names))
        seen[self.rank, :self.world] = torch.tensor([n not in missing for n in names])
        seen[self.rank, self.world] = int(bool(failed))
        seen = seen.to(self.device)
        dist.all_reduce(seen)
        self.barrier()
        shared.unmark(path, names[self.rank])
        problems = {}
        for r, row in enumerate(seen.cpu().tolist()):
            gone = [str(c) for c in range(self.world) if not row[c] and c != r]
            if row[self.world] or gone:
                problems[f"rank {r}"] = "cannot write into it" if row[self.world] else \
                    "does not see the files of rank " + ", ".join(gone)
        return shared.not_shared(setting, path, problems, fix) if problems else ""

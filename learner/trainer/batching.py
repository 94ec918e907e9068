"""Token-budgeted batches of trajectories, complete groups for group estimators, and collation.

A batch closes once its trajectories hold `tokens` tokens (prompt + response + observations) or
`max_trajectories` of them; in sync mode it closes at exactly `sync_batch` trajectories. With
`group_size` set, trajectories wait until their group (`group_id`, falling back to `task_id`) is
complete (the trajectories' own `group_size` when the agent set one, else `group_size`) and enter
the buffer together, so a batch never splits a group.

`collate` also gives each row the temperature its trajectory was sampled at (`Batch.temperature`):
the learner scores at that temperature (`learner.models.scoring`), so the ratio pi/mu is 1 on-policy.
Top-p is not applied when scoring (as in verl): the behaviour log-probs the engines record are those
of the truncated, renormalised distribution (`learner.engines.sampling`), so for a token inside the
nucleus of mass Z the on-policy ratio is pi_T / (pi_T / Z) = Z, in [top_p, 1]: the exact importance
weight of the untruncated policy the learner trains. With top_p >= 1 - eps_low the clip keeps those
tokens. Greedy trajectories (temperature <= 0) never get here: admission drops them
(`learner.trainer.staleness`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.models.tokenizer import PAD_ID
from streamer.wire.schema import Trajectory


def group_key(t: Trajectory) -> str:
    return t.group_id or t.task_id


class Batcher:
    def __init__(self, tokens: int, max_trajectories: int, group_size: int | None = None,
                 sync_batch: int | None = None, drop_uniform_groups: bool = False) -> None:
        self.tokens, self.max_trajectories = tokens, max_trajectories
        self.group_size, self.sync_batch = group_size, sync_batch
        self.drop_uniform_groups = drop_uniform_groups
        self.ready: list[list[Trajectory]] = []  # units (a trajectory, or a complete group) in arrival order
        self.partial: dict[str, list[Trajectory]] = {}
        self.dropped_uniform = 0  # trajectories of groups whose rewards were all equal

    def add(self, t: Trajectory) -> None:
        if self.group_size is None:
            self.ready.append([t])
            return
        members = self.partial.setdefault(group_key(t), [])
        members.append(t)
        if len(members) >= (t.group_size if t.group_size > 1 else self.group_size):  # the agent's n wins
            group = self.partial.pop(group_key(t))
            if self.drop_uniform_groups and len({m.reward for m in group}) == 1:
                # DAPO dynamic sampling: all-equal rewards give zero advantage, no signal
                # (https://arxiv.org/abs/2503.14476)
                self.dropped_uniform += len(group)
                return
            self.ready.append(group)

    def _n(self) -> int:
        return sum(len(u) for u in self.ready)

    def _tokens(self) -> int:
        return sum(len(t.tokens) for u in self.ready for t in u)

    def has_batch(self) -> bool:
        if self.sync_batch is not None:
            return self._n() >= self.sync_batch
        return bool(self.ready) and (self._tokens() >= self.tokens or self._n() >= self.max_trajectories)

    def take(self, flush: bool = False) -> list[Trajectory]:
        """The next batch (units from the front); with flush, whatever complete units there are."""
        if not (flush or self.has_batch()):
            return []
        limit_n = self.sync_batch if self.sync_batch is not None else self.max_trajectories
        out: list[Trajectory] = []
        n_tok = 0
        while self.ready:
            unit = self.ready[0]
            if out and (len(out) + len(unit) > limit_n or (self.sync_batch is None and n_tok >= self.tokens)):
                break
            out += self.ready.pop(0)
            n_tok += sum(len(t.tokens) for t in unit)
        return out

    def pending(self) -> list[Trajectory]:
        """Everything buffered (complete and partial), in a deterministic order, for a checkpoint."""
        return [t for u in self.ready for t in u] + [t for g in self.partial.values() for t in g]

    def drop_where(self, stale) -> list[Trajectory]:
        """Remove and return the buffered units for which `stale(unit)` is true (sync mode)."""
        keep, gone = [], []
        for u in self.ready:
            (gone if stale(u) else keep).append(u)
        self.ready = keep
        return [t for u in gone for t in u]


@dataclass
class Batch:
    """Right-padded `[B, T]` tensors of a list of trajectories, aligned with the tokens."""

    input_ids: torch.Tensor  # long
    attention_mask: torch.Tensor  # 1 on real tokens
    loss_mask: torch.Tensor  # float, 1 on generated tokens (never the first token: nothing predicts it)
    old_logp: torch.Tensor  # behaviour log-probs, 0 off the loss mask
    rewards: torch.Tensor  # [B]
    trajectories: list[Trajectory]
    temperature: torch.Tensor | None = None  # [B] sampling temperature of each row; None: all 1

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> "Batch":
        """The tensors on `device` (the megatron backend's GPU); a no-op where they already are."""
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device),
                     self.old_logp.to(device), self.rewards.to(device), self.trajectories,
                     None if self.temperature is None else self.temperature.to(device))

    def rows(self, start: int, stop: int) -> "Batch":
        """Rows start..stop, cut to their own longest row: the columns past it are padding in every row."""
        sl = slice(start, stop)
        width = max(int(self.attention_mask[sl].sum(-1).max()), 1) if stop > start else self.input_ids.shape[1]
        cols = slice(0, width)
        temp = None if self.temperature is None else self.temperature[sl]
        return Batch(self.input_ids[sl, cols], self.attention_mask[sl, cols], self.loss_mask[sl, cols],
                     self.old_logp[sl, cols], self.rewards[sl], self.trajectories[sl], temp)


def by_length(trajs: list[Trajectory]) -> list[Trajectory]:
    """Shortest first, so that each micro-batch (`Batch.rows`) pads only to the rows of similar length beside it."""
    return sorted(trajs, key=lambda t: len(t.tokens))


def collate(trajs: list[Trajectory]) -> Batch:
    if not trajs:
        raise ValueError("collate: empty batch")
    b, t = len(trajs), max(len(x.tokens) for x in trajs)
    ids = torch.full((b, t), PAD_ID, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t)
    old = torch.zeros(b, t)
    for i, x in enumerate(trajs):
        n = len(x.tokens)
        ids[i, :n] = torch.tensor(x.tokens, dtype=torch.long)
        attn[i, :n] = 1
        m = torch.tensor(x.loss_mask, dtype=torch.float32)
        m[: max(1, x.prompt_len)] = 0.0  # the prompt is never trained on
        mask[i, :n] = m
        old[i, :n] = torch.where(m.bool(), torch.tensor(x.logprobs, dtype=torch.float32), torch.zeros(n))
    rewards = torch.tensor([x.reward for x in trajs], dtype=torch.float32)
    temperature = torch.tensor([x.temperature for x in trajs], dtype=torch.float32)
    return Batch(ids, attn, mask, old, rewards, list(trajs), temperature)

"""The learner's checkpoints: what a checkpoint holds (weights, optimizers, buffered trajectories, source positions
and the bookkeeping that goes with them), writing one over one rank or several, and restoring the latest intact one.

A mixin of learner.trainer.loop.Trainer, whose attributes it reads and sets.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from learner.trainer import checkpoint as ckpt

log = logging.getLogger(__name__)


class Checkpointing:
    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimizer of each trained model, by the model's name ("policy", and "value" with a critic)."""
        opts = {"policy": self.models.policy_opt}
        if self.models.value is not None:
            opts["value"] = self.models.value_opt
        return opts

    def checkpoint(self) -> None:
        """Write a checkpoint; `checkpoint.OutOfSpace` (its temporary directory removed) on a full filesystem."""
        for sink in self.sinks:  # what the steps before it emitted is kept before their positions are committed
            if hasattr(sink, "flush"):
                sink.flush()
        with ckpt.space_guard(self.cfg.checkpoint.dir if self.leader else None, "checkpoint.dir"):
            self._save()

    def _save(self) -> None:
        state = {"version": self.version, "version_index": self.vindex, "redo_until": self.redo_until,
                 "policy_steps": self.policy_steps, "positions": self.positions,
                 "admission": self.admission.state(), "counters": dict(self.counters),
                 "value_ema": self.value_ema, "warm_left": self.warm_left, "layout": self.backend.layout(),
                 "cluster_id": self.cluster}
        if self.quarantine is not None:
            state["offsets"] = self.quarantine.state(self.batcher.pending())
        opts = self._optimizers()
        # a backend that writes by shard (megatron): each rank its part, below; no rank holds the whole model
        by_shard = getattr(self.backend, "checkpoints_by_shard", False)
        hf = {} if by_shard else {name: self.backend.export_hf(name) for name in opts}  # a collective
        root, g = self.cfg.checkpoint.dir, self.group
        if g is None and not by_shard:
            ckpt.save_checkpoint(root, self.step, hf, opts, state, self.batcher.pending(), self.cfg.checkpoint.keep)
            self.source.commit(self.positions)
            return
        tmp = ckpt.tmp_dir(root, self.step, "ranks")
        if self.leader:
            ckpt.begin_checkpoint(root, self.step, "ranks")
        if g is not None:
            g.barrier()
        if by_shard:
            self.backend.save_shards(tmp, list(opts))
        else:
            ckpt.save_optimizers(tmp, opts, rank=g.rank)
        if g is not None:
            g.barrier()
        if self.leader:
            ckpt.finish_checkpoint(root, tmp, self.step, hf, state, self.batcher.pending(), self.cfg.checkpoint.keep)
            self.source.commit(self.positions)
        if g is not None:
            g.barrier()

    def _load_whole(self, path, opts: dict) -> tuple[dict, list]:
        """Restore a checkpoint that holds each model whole (HF format) and its optimizer state in HF naming or per
        rank; (state, pending trajectories)."""
        free = ckpt.layout_free(path, opts) if hasattr(self.backend, "import_optimizer") else None
        ckpt.check_layout(path, self.backend.layout(), reshards=free is not None)
        hf = {name: self.backend.hf_target(name) for name in opts}  # the checkpoint holds HF-format weights
        state, pending = ckpt.load_checkpoint(path, hf, {} if free else opts, self.group.rank if self.group else None)
        for name, model in hf.items():
            self.backend.import_hf(name, model)
        for name, (file, meta) in (free or {}).items():  # cut for this rank's layout, whichever wrote it
            self.backend.import_optimizer(name, file, meta)
        return state, pending

    def resume(self) -> bool:
        """Restore from the latest checkpoint in checkpoint.dir, if any; the source seeks to its offsets."""
        c = self.cfg.checkpoint
        if self.leader:
            ckpt.clean_tmp(c.dir)
            ckpt.check_space(c.dir)
            if hasattr(self.publisher, "store"):
                ckpt.clean_tmp(self.publisher.store.root)
        path = ckpt.intact_checkpoint(c.dir, c.from_scratch) if c.resume and self.leader else None
        if self.group is not None:  # the others look once the leader has moved damaged ones (from_scratch)
            self.group.barrier()
            path = ckpt.intact_checkpoint(c.dir) if c.resume and not self.leader else path
        if path is None:
            return False
        opts = self._optimizers()
        if ckpt.written_by_shard(path):  # each rank reads its part (any layout of the backend that wrote it)
            ckpt.check_layout(path, self.backend.layout(), reshards=hasattr(self.backend, "load_shards"))
            state, pending = ckpt.load_checkpoint(path, {}, {})
            self.backend.load_shards(path, list(opts))
        else:
            state, pending = self._load_whole(path, opts)
        self.step, self.version, self.policy_steps = state["step"], state["version"], state["policy_steps"]
        self.vindex, self.redo_until = state.get("version_index", self.version), state.get("redo_until", -1)
        self.resumed = True
        self.positions = {k: int(v) for k, v in state["positions"].items()}
        self.cluster = state.get("cluster_id")
        self.admission.load_state(state["admission"])
        self.counters = Counter(state["counters"])
        self.value_ema, self.warm_left = state["value_ema"], state["warm_left"]
        if self.quarantine is not None:
            self.quarantine.load_state(state.get("offsets", {}))
        for t in pending:
            self.batcher.add(t)
        log.info("resumed from %s: step %d, version %d, %d buffered", path, self.step, self.version, len(pending))
        return True

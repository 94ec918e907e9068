"""The continuous learner: read trajectories, batch them, update, publish versions, checkpoint.

Exactly-once: a record read from the source is, at every moment, either trained (its effect is in the weights),
dropped (counted), or buffered. A checkpoint stores the weights, the buffer and the source positions together, so a
restart from it neither loses nor repeats a trajectory; the steps after it are redone from the same records.

The models' backend (`Models.backend`, see learner.backends.base) says where batches go, exports and imports
the weights, and names the ranks. Over several ranks (the backend's `group`; see learner.trainer.ranks) every
rank runs this loop: the leader (rank 0) alone reads the source, batches, emits events, writes the weight store
and commits offsets; it broadcasts each batch (or the decision to stop) and every rank trains on its rows.
Exporting weights (publication, checkpoints) is collective: every rank calls it; a backend that splits the model
(megatron) publishes each version by shard, every rank writing its own part into the leader's store
(learner.trainer.publish_shards).

A batch whose training raises is counted against its trajectories and, once it has failed `batch.poison_after`
times (across restarts), dead-lettered instead of redone (learner.trainer.quarantine). A full filesystem under the
checkpoints or the weight store ends the learner with `checkpoint.OutOfSpace` (its temporary directories removed),
and a checkpoint directory whose checkpoints are all damaged stops it instead of starting from offset 0.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter
from typing import Callable

import torch

from learner.algorithms import NEEDS_GROUPS
from learner.config import LearnerConfig
from learner.trainer import checkpoint as ckpt
from learner.trainer.batching import Batcher, by_length, collate, group_key
from learner.trainer.persistence import Checkpointing
from learner.trainer.publish import Publisher
from learner.trainer.publish_shards import publish_sharded
from learner.trainer.quarantine import Quarantine, injected_fault
from learner.trainer.ranks import RankGroup
from learner.trainer.source import Source
from learner.trainer.staleness import Admission, histogram, staleness
from learner.trainer.step import HalfApplied, Models, prepare, update
from streamer.wire.schema import LearnerEvent, Trajectory

log = logging.getLogger(__name__)
KEEPALIVE_S = 60.0  # several ranks: the longest the leader waits for trajectories without telling the others


class Trainer(Checkpointing):
    def __init__(self, cfg: LearnerConfig, models: Models, source: Source | None, publisher: Publisher | None = None,
                 sinks: list[Callable[[LearnerEvent], None]] = ()) -> None:
        """`models.backend` must be set (learner.train.build_models does). Over several ranks only the leader
        passes a source, publisher and sinks (the others None, [])."""
        if models.backend is None:
            raise ValueError("Trainer: models.backend is None; build the models with learner.train.build_models")
        self.cfg, self.models, self.source, self.publisher, self.sinks = cfg, models, source, publisher, list(sinks)
        self.backend = models.backend
        self.group: RankGroup | None = self.backend.group
        self.device = self.backend.device
        self.leader = self.group is None or self.group.leader
        # every rank advances the version; only the leader knows whether there is a weight store
        has_store = publisher is not None
        self.publishes = has_store if self.group is None else bool(self.group.share_int(int(has_store)))
        # over several ranks, a backend that splits the model publishes by shard into the leader's store
        self.by_shard = self.publishes and self.group is not None and bool(self.group.share_int(
            int(hasattr(publisher, "store"))))
        # a group estimator's batches take whole groups; gae and reinforce_pp take trajectories, from groups or not
        self.grouped = grouped = cfg.advantage.estimator in NEEDS_GROUPS
        b = cfg.batch
        hf = self.backend.hf_config
        vocab, positions = getattr(hf, "vocab_size", None), getattr(hf, "max_position_embeddings", None)
        self.admission = Admission(b.max_staleness, grouped, b.dedup_window, b.sync, vocab, positions)
        self.admission.live = bool(getattr(source, "live", False))  # a topic: versions newer than ours are lies
        self.batcher = Batcher(b.tokens, b.max_trajectories, cfg.advantage.group_size if grouped else None,
                               b.sync_batch if b.sync else None, grouped and cfg.advantage.dynamic_sampling)
        # the leader's: failure counts of batches, offsets of buffered trajectories (for their dead letters)
        self.quarantine = None if source is None else Quarantine(cfg.checkpoint.dir, b.poison_after,
                                                                 self.admission.key)
        self.step = self.policy_steps = self.version = 0
        self.vindex = 0  # the lineage index of `version` (staleness counts it; see staleness.Lineage)
        self.redo_until = -1  # after a restart: publication points up to this index were published before the crash
        self.resumed = False
        self.unpublished = 0  # steps since the last published version
        self.positions, self.cluster = {}, None  # source positions, and the broker cluster they were read from
        self.counters: Counter[str] = Counter()
        self.value_ema: float | None = None
        self.warm_left = cfg.value.warmup_steps
        self.idle_s = 0.0
        self.last_arrival = time.monotonic()  # of a trajectory from the source (see `_idle_flush`)
        self.stop = False

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Train until max_steps or the end of a finite source; returns the number of steps run."""
        self.start()
        if not self.resumed and self.step == 0:  # a crash before the first periodic checkpoint resumes too,
            self.checkpoint()                     # so its redo publishes nothing twice (see `start`)
        started, last_ckpt = self.step, self.step
        while self._keep_going():
            if not self.step_once():
                break
            if self.step - last_ckpt >= self.cfg.checkpoint.every:
                self.checkpoint()
                last_ckpt = self.step
        self.checkpoint()
        return self.step - started

    def _keep_going(self) -> bool:
        go = not self.stop and not (self.cfg.max_steps and self.step >= self.cfg.max_steps)
        return go if self.group is None else bool(self.group.share_int(int(go)))  # the leader decides

    def step_once(self) -> bool:
        """Wait for a batch, train on it, emit the event; False once a finite source is drained."""
        if self.group is None:
            trajs = self.next_batch()
        else:  # an idle leader still speaks every KEEPALIVE_S: a silent one would hit the collective timeout
            trajs = []
            while trajs == []:
                trajs = self.group.share_trajectories(self.next_batch(KEEPALIVE_S) if self.leader else None)
        if trajs is None:
            return False
        self._emit(self.train_on(trajs))
        return True

    def _emit(self, event: LearnerEvent | None) -> None:
        for sink in self.sinks if event is not None else ():
            sink(event)

    def next_batch(self, max_wait_s: float | None = None) -> list[Trajectory] | None:
        """The next batch to train on; None once a finite source is drained; [] when none came within
        `max_wait_s`."""
        t0 = time.monotonic()
        if self.cfg.batch.sync:  # sync mode trains only on the current version
            self.counters["stale"] += len(self.batcher.drop_where(
                lambda unit: any(staleness(t, self.vindex, self.admission.lineage) > 0 for t in unit)))
        while not self.batcher.has_batch() and not self.stop:
            if self.source.exhausted:
                rest = self.batcher.take(flush=True) if self.cfg.batch.flush_at_end else []
                return self._without_poison(rest) if rest else None
            rest = self._idle_flush()
            if rest:
                self.idle_s += time.monotonic() - t0
                return rest
            for traj, off in self.source.poll(max_records=256, timeout_s=0.2):
                self.last_arrival = time.monotonic()
                self.positions[off.partition] = off.next
                verdict = self.admission.admit(traj, self.vindex)
                if verdict == "ok":
                    self.quarantine.remember(traj, off)
                    self.batcher.add(traj)
                elif verdict == "invalid":
                    self.source.reject(traj, off, self.admission.last_invalid)
            if max_wait_s is not None and time.monotonic() - t0 > max_wait_s and not self.batcher.has_batch():
                self.idle_s += time.monotonic() - t0
                return []
        self.idle_s += time.monotonic() - t0
        batch = self.batcher.take()
        return self._without_poison(batch) if batch else None

    def _idle_flush(self) -> list[Trajectory]:
        """The buffered complete units as a batch once no trajectory came for `batch.idle_flush_s`, else [].
        Agents pace themselves on versions, and the trajectories they count can exceed those the learner keeps
        (a task redone after a rebalance arrives twice and is dropped once): both would wait for each other."""
        wait = self.cfg.batch.idle_flush_s
        if not wait or time.monotonic() - self.last_arrival < wait:
            return []
        rest = self._without_poison(self.batcher.take(flush=True))
        if rest:
            self.counters["idle_flushes"] += 1
            log.info("no trajectory for %.0f s: training on the %d buffered", wait, len(rest))
        return rest

    def _without_poison(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """`trajs` less the poison ones (and their groups), which go to the dead letters."""
        keep, poison = self.quarantine.split(trajs, group_key if self.grouped else None)
        if poison:
            self.quarantine.dead_letter(poison, self.source)
            self.counters["poison"] += len(poison)
        return keep

    def train_on(self, trajs: list[Trajectory]) -> LearnerEvent | None:
        fresh, _ = self.admission.split_stale(trajs, self.vindex, group_key if self.grouped else None)
        if not fresh:
            return None
        t0 = time.monotonic()
        hist = histogram(fresh, self.vindex, self.admission.lineage)  # against the version the update starts from
        warm, rng = self.models.value is not None and self.warm_left > 0, torch.get_rng_state()
        try:
            n_tokens, metrics, n_applied = self._learn(fresh, warm)
        except Exception as e:
            if not self._dead_letters_it(fresh, e):
                raise
            torch.set_rng_state(rng)  # as if the batch had never come: a redo after a crash skips it the same way
            return self._isolate(fresh)
        if self.quarantine is not None:
            self.quarantine.trained(fresh)
        self.step += 1
        self._after_update(metrics, n_applied > 0, warm)
        metrics["updates_applied"] = float(n_applied)
        step_s = time.monotonic() - t0
        return self._event(fresh, n_tokens, metrics, n_applied > 0, warm, step_s, hist)

    def _learn(self, fresh: list[Trajectory], warm: bool) -> tuple[int, dict[str, float], int]:
        """The batch's updates: (its tokens, metrics, updates applied). What raises here is the batch's failure."""
        injected_fault(fresh)
        batch = collate(by_length(fresh)).to(self.device)
        shard = self.group.shard(len(fresh)) if self.group is not None else None
        ref = prepare(self.cfg, self.models, batch, values_from_update=shard is None, train_policy=not warm)
        n_applied, metrics = 0, {}
        for _ in range(self.cfg.optim.updates_per_batch):
            try:
                metrics, ok = update(self.cfg, self.models, batch, ref, train_policy=not warm, shard=shard)
            except Exception as e:
                if n_applied:
                    raise HalfApplied(f"update {n_applied + 1} of the batch failed ({type(e).__name__}: {e})") from e
                raise
            if not ok:  # the weights keep the updates already applied; the rest of the batch is dropped
                self.counters["skipped_updates"] += 1
                break
            n_applied += 1
        return batch.n_tokens, metrics, n_applied

    def _dead_letters_it(self, fresh: list[Trajectory], error: Exception) -> bool:
        """Count the failure; True when the poison it found can be isolated here and the learner go on: one rank,
        and weights the batch did not touch. Otherwise the learner goes down (the restarted one drops the poison)."""
        if self.quarantine is None:  # a rank other than the leader: the leader counts
            return False
        poison = self.quarantine.failed(fresh, error)
        return poison and self.group is None and not isinstance(error, HalfApplied)

    def _isolate(self, trajs: list[Trajectory]) -> LearnerEvent | None:
        """A poison batch's halves train as batches of their own (a half that fails is halved again), so only a
        unit (trajectory or group) that fails alone is dead-lettered; returns the last half's event."""
        units = self.quarantine.units(trajs, group_key if self.grouped else None)
        if len(units) == 1:
            return self.train_on(self._without_poison(trajs))
        self._emit(self.train_on([t for u in units[:len(units) // 2] for t in u]))
        return self.train_on([t for u in units[len(units) // 2:] for t in u])

    # ------------------------------------------------------------------ bookkeeping
    def _after_update(self, metrics: dict[str, float], applied: bool, warm: bool) -> None:
        if not applied:
            self.counters["skipped_steps"] += 1
            log.warning("step %d: non-finite loss or gradient, step skipped", self.step)
        elif warm:
            self.warm_left -= 1
        else:
            self.policy_steps += 1
        # Agents pace themselves on versions (sync: one batch per version; async: `versions_ahead`), so a
        # critic-only or skipped step publishes one too (the same policy weights), or they would wait forever.
        self.unpublished += 1
        if self.cfg.batch.sync or self.unpublished >= self.cfg.batch.sync_every:
            self._advance()
            self.unpublished = 0
        if applied:
            self._watch_value_loss(metrics.get("value_loss"), warm)

    def _watch_value_loss(self, v: float | None, warm: bool) -> None:
        """Re-enter critic-only warm-up when the value loss spikes (a drift the critic has not seen)."""
        vc = self.cfg.value
        if v is None:
            return
        if self.value_ema is not None and not warm and vc.rewarm_steps and v > vc.spike_factor * self.value_ema:
            self.warm_left = vc.rewarm_steps
            self.counters["rewarms"] += 1
            log.info("step %d: value loss %.4g > %.1f x mean %.4g: %d critic-only steps", self.step, v,
                     vc.spike_factor, self.value_ema, vc.rewarm_steps)
        self.value_ema = v if self.value_ema is None else vc.spike_ema * self.value_ema + (1 - vc.spike_ema) * v

    def _advance(self) -> None:
        """A publication point. A version exists only once published: without a publisher (replaying a recording
        with no agents listening) the version stays put and staleness is the recording's own. Redoing the steps a
        crash lost, the learner publishes nothing until it is past what it had published before the crash: the
        agents generated for those versions already, and new versions would let them generate again."""
        if not self.publishes:
            return
        self.vindex += 1
        if self.vindex <= self.redo_until:  # the lost step's version exists: same index, same number
            self.version += 1
            self.counters["redone_versions"] += 1
            return
        self._publish(self.version + 1, self.vindex)

    def _publish(self, number: int, index: int) -> None:
        store = getattr(self.publisher, "store", None)  # a full disk under it ends the learner (OutOfSpace)
        with ckpt.space_guard(store.root if store else None, "io.weights_dir"):
            self._write_version(number)
        self.version = number
        self.admission.lineage.anchor(number, index)

    def _write_version(self, number: int) -> None:
        shard = self.backend.export_shard("policy") if self.by_shard else None
        if shard is not None:  # each rank writes its own part (a collective); no rank holds the whole model
            publish_sharded(self.publisher, shard, self.backend.hf_config, number, self.step, self.group)
        else:
            model = self.backend.export_hf("policy")  # a collective over the ranks
            if self.publisher is not None:
                self.publisher.publish(model, number, self.step)

    def _event(self, trajs, n_tokens, metrics, applied, warm, step_s, hist) -> LearnerEvent:
        m = {f"learner/{k}": float(v) for k, v in metrics.items()}
        m.update({"learner/value_warmup": float(warm), "learner/policy_steps": float(self.policy_steps),
                  "perf/step_s": step_s, "perf/tokens_per_s": n_tokens / max(step_s, 1e-9),
                  "perf/idle_s": self.idle_s})
        for k, v in (self.admission.counts + self.counters).items():
            m[f"learner/count_{k}"] = float(v)
        m["learner/dead_letters"] = float(self._dead_letters())
        if self.batcher.drop_uniform_groups:
            m["learner/count_uniform_group"] = float(self.batcher.dropped_uniform)
        self.idle_s = 0.0
        return LearnerEvent(step=self.step, version=self.version, time=time.time(), n_trajectories=len(trajs),
                            n_tokens=n_tokens, metrics=m, staleness=hist,
                            task_ids=[t.task_id for t in trajs], skipped=not applied)

    def _dead_letters(self) -> int:
        return getattr(self.source, "dead_letters", 0) if self.source is not None else 0

    def start(self) -> None:
        """Seek the source to the restored positions and publish the starting version."""
        if self.source is not None:
            self.source.seek(self.positions, self.cluster)  # refused when the broker lost what the positions read
            self.cluster = self.source.cluster_id()
        if not self.publishes:
            return
        latest = self.publisher.latest_version() if self.publisher is not None else None
        if self.group is not None:  # the leader's store decides
            latest = self.group.share_int(-1 if latest is None else latest)
            latest = None if latest < 0 else latest
        if latest is None:
            self._publish(self.version, self.vindex)
        elif self.resumed and latest >= self.version:
            # The versions after our checkpoint were published by the steps the crash lost. This run redoes those
            # steps from the same records and RNG state (the same weights), publishing nothing until it is past
            # them: agents keep the versions they hold, and what they generated keeps its staleness.
            self.redo_until = max(self.redo_until, self.admission.lineage.index(latest))
            self.admission.lineage.newest = latest  # the agents may hold versions up to it while we redo
        elif latest >= self.version:  # a new lineage over an old store: never reuse a number
            self._publish(latest + 1, self.vindex)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT finish the current step, checkpoint and return."""
        def handler(signum, _frame):
            log.info("signal %d: stopping after this step", signum)
            self.stop = True
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

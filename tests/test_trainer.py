"""The continuous learner on a tiny real policy: admission, batching, checkpoints, NaN guard, modes."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest
import torch

from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.batching import Batcher, by_length, collate
from learner.trainer.checkpoint import flatten_optimizer, latest_checkpoint, unflatten_optimizer
from learner.trainer.loop import Trainer
from learner.trainer.publish import DirectoryPublisher
from learner.trainer.source import BusSource, FileSource, write_trajectories
from learner.trainer.staleness import Admission
from learner.trainer.step import _micro, prepare, update
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.weights import WeightStore
from streamer.wire.config import ConfigError, load_config
from streamer.wire.schema import Trajectory


@pytest.fixture(scope="module")
def policy0():
    return build_policy(tiny_model_config(), seed=0)


def make_cfg(tmp_path, *overrides: str) -> LearnerConfig:
    """Policy updates from the first step (no critic warm-up) and no KL anchor, unless a test asks for them."""
    return load_config(LearnerConfig, None, TINY_OVERRIDES + [f"checkpoint.dir={tmp_path / 'ck'}", "threads=1",
                                                             "checkpoint.every=1000", "value.warmup_steps=0",
                                                             "value.rewarm_steps=0", "loss.kl_coef=0", *overrides])


def make_trainer(cfg, source, publisher=None):
    events = []
    return Trainer(cfg, build_models(cfg), source, publisher, [events.append]), events


def file_source(tmp_path, trajs, name="t.jsonl"):
    return FileSource(write_trajectories(tmp_path / name, trajs, append=False))


def with_(t: Trajectory, **changes) -> Trajectory:
    return msgspec.structs.replace(t, **changes)


# ---------------------------------------------------------------------- admission and batching

def test_admission_dedup_staleness_validity(policy0):
    t = synthetic_trajectories(policy0, 3, version=5)
    adm = Admission(max_staleness=2)
    assert adm.admit(t[0], version=7) == "ok"  # staleness 2: allowed
    assert adm.admit(with_(t[0], traj_id="other"), version=7) == "duplicate"  # same task id
    assert adm.admit(t[1], version=8) == "stale"  # staleness 3
    assert adm.admit(with_(t[2], reward=math.nan), version=5) == "invalid"
    bad_lp = list(t[2].logprobs)
    bad_lp[t[2].loss_mask.index(1)] = math.inf
    assert adm.admit(with_(t[2], task_id="x", logprobs=bad_lp), version=5) == "invalid"
    assert adm.counts == Counter(ok=1, duplicate=1, stale=1, invalid=2)
    # group estimators key by (group, member): two members of one task are both admitted
    g = synthetic_trajectories(policy0, 2, group_size=2)
    adm = Admission(max_staleness=0, grouped=True)
    assert [adm.admit(x, 0) for x in g + g[:1]] == ["ok", "ok", "duplicate"]
    # ... also when the learner uses a value model (a member is not a duplicate of its sibling)
    adm_single = Admission(max_staleness=0)
    assert [adm_single.admit(x, 0) for x in g] == ["ok", "ok"]
    # at training time a group is stale when its oldest member is
    mixed = [g[0], with_(g[1], policy_version=-1)]
    fresh, stale = adm.split_stale(mixed, version=0, group_key=lambda x: x.group_id)
    assert fresh == [] and len(stale) == 2
    # the de-duplication window survives a checkpoint
    adm2 = Admission(0, grouped=True)
    adm2.load_state(adm.state())
    assert adm2.admit(g[1], 0) == "duplicate"


def test_batcher_token_budget_groups_and_sync(policy0):
    t = synthetic_trajectories(policy0, 6)
    lens = [len(x.tokens) for x in t]
    b = Batcher(tokens=lens[0] + lens[1], max_trajectories=100)
    b.add(t[0])
    assert not b.has_batch()
    for x in t[1:]:
        b.add(x)
    assert b.take() == t[:2]  # closes once the budget is reached
    assert not b.has_batch() or b.take()  # the rest may or may not fill a budget
    b = Batcher(tokens=10_000, max_trajectories=100)
    for x in t:
        b.add(x)
    assert not b.has_batch() and b.take() == []
    assert b.take(flush=True) == t  # flush: the next batch within the limits, however small
    # groups enter only complete, and together
    g = synthetic_trajectories(policy0, 6, group_size=3)
    b = Batcher(tokens=1, max_trajectories=100, group_size=3)
    for x in [g[0], g[3], g[1], g[4]]:
        b.add(x)
    assert not b.has_batch() and len(b.pending()) == 4
    b.add(g[5])
    assert b.take() == [g[3], g[4], g[5]]
    # the agent's group size (on the trajectories) decides when a group is complete
    b = Batcher(tokens=1, max_trajectories=100, group_size=8)
    for x in g[:3]:
        b.add(x)
    assert b.take() == g[:3]
    # dynamic sampling: a group whose rewards are all equal is dropped when it completes
    b = Batcher(tokens=1, max_trajectories=100, group_size=3, drop_uniform_groups=True)
    uniform = [with_(m, reward=1.0) for m in g[:3]]
    mixed = [with_(m, reward=r) for m, r in zip(g[3:], (0.0, 1.0, 0.0))]
    for x in uniform + mixed:
        b.add(x)
    assert b.dropped_uniform == 3 and b.pending() == mixed
    # sync: exactly sync_batch trajectories
    b = Batcher(tokens=1, max_trajectories=1, sync_batch=4)
    for x in t:
        b.add(x)
    assert b.take() == t[:4] and not b.has_batch()


def test_collate_alignment(policy0):
    t = synthetic_trajectories(policy0, 2)
    batch = collate(t)
    for i, x in enumerate(t):
        n = len(x.tokens)
        assert batch.input_ids[i, :n].tolist() == x.tokens and batch.attention_mask[i, n:].sum() == 0
        assert batch.loss_mask[i, :n].tolist() == [float(m) for m in x.loss_mask]
        assert batch.old_logp[i, :n].tolist() == pytest.approx(x.logprobs)


def test_micro_batches_close_at_size_and_at_doubled_length(policy0):
    lengths = [2, 3, 4, 5, 9, 10]
    t = [with_(x, tokens=x.tokens[:1] * n, loss_mask=[0] + [1] * (n - 1), logprobs=[0.0] * n, prompt_len=1)
         for x, n in zip(synthetic_trajectories(policy0, 6), lengths)]
    batch = collate(t)
    assert list(_micro(batch, 4)) == [(0, 3), (3, 6)]  # 5 > 2 * 2 closes the first
    assert list(_micro(batch, 2)) == [(0, 2), (2, 4), (4, 6)]
    assert batch.rows(0, 3).input_ids.shape == (3, 4) and batch.rows(3, 6).input_ids.shape == (3, 10)
    assert [len(x.tokens) for x in by_length(t[::-1])] == lengths
    # one rank's shard (by_length False): by size alone, so the shards of every rank (as many rows each) make as
    # many micro-batches, whatever their lengths (expert parallelism: each forward is a collective of all ranks)
    assert list(_micro(batch, 4, by_length=False)) == [(0, 4), (4, 6)]
    assert list(_micro(batch.rows(0, 3), 2, by_length=False)) == list(_micro(batch.rows(3, 6), 2, by_length=False))


@pytest.mark.parametrize("kl", ["k3", "forward"])
def test_length_sorted_micro_batches_give_the_whole_batch_update(tmp_path, policy0, kl):
    t = synthetic_trajectories(policy0, 8)
    assert len({len(x.tokens) for x in t}) > 2
    after = []
    for micro, order in ((1000, t), (2, by_length(t))):
        cfg = make_cfg(tmp_path, f"batch.micro_batch={micro}", "loss.kl_coef=0.1", f"loss.kl_type={kl}")
        models = build_models(cfg)
        batch = collate(order)
        metrics, applied = update(cfg, models, batch, prepare(cfg, models, batch), train_policy=True)
        assert applied
        after.append((metrics, _params(models.policy), _params(models.value)))
    (m1, p1, v1), (m2, p2, v2) = after
    for k in ("policy_loss", "value_loss", "kl_ref", "grad_norm", "value_grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), k
    # after one AdamW step a weight moves by lr * g / (|g| + eps): where |g| is near eps (1e-8: the value model's
    # router gates) a 1e-9 change of the summation order moves it by a sizeable part of lr (1e-3), measured 1.2e-6 on
    # one machine; a wrong micro-batch weighting shows in the gradient norms above
    assert all(torch.allclose(p2[k], p1[k], atol=1e-5) for k in p1)
    assert all(torch.allclose(v2[k], v1[k], atol=1e-5) for k in v1)


def test_critic_references_from_the_first_update_equal_prepares(tmp_path, policy0):
    # the trainer leaves the critic's values to the first update's own value forward (one forward fewer a batch):
    # references, metrics and weights must be bit for bit those of prepare's no-gradient forward, also on the second
    # update of the batch (where the value clip binds) and over micro-batches of several widths
    t = by_length(synthetic_trajectories(policy0, 8))
    sets = ("batch.micro_batch=3", "optim.updates_per_batch=2", "value.value_clip=0.2", "advantage.batch_norm=true",
            "advantage.adaptive_alpha=0.05", "loss.kl_coef=0.1")
    runs = []
    for lazy in (False, True):
        cfg = make_cfg(tmp_path, *sets)
        models, batch = build_models(cfg), collate(t)
        ref = prepare(cfg, models, batch, values_from_update=lazy)
        assert ("old_values" in ref) is not lazy and ("advantages" in ref) is not lazy
        steps = [update(cfg, models, batch, ref, train_policy=True) for _ in range(2)]
        assert all(applied for _, applied in steps)
        runs.append((ref, [m for m, _ in steps], _params(models.policy), _params(models.value)))
    (r0, m0, p0, v0), (r1, m1, p1, v1) = runs
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
    assert m0 == m1 and m0[1]["value_clip_frac"] > 0  # the second update's clip did bind
    assert all(torch.equal(p0[k], p1[k]) for k in p0) and all(torch.equal(v0[k], v1[k]) for k in v0)


def test_a_critic_only_batch_gets_no_policy_references(tmp_path, policy0):
    # during critic warm-up the policy loss is not computed: prepare skips its references (two policy forwards)
    cfg = make_cfg(tmp_path, "loss.name=decoupled_ppo", "loss.kl_coef=0.1")
    models, batch = build_models(cfg), collate(synthetic_trajectories(policy0, 4))
    assert {"prox_logp", "ref_logp"} <= prepare(cfg, models, batch).keys()
    ref = prepare(cfg, models, batch, train_policy=False)
    assert {"old_values", "returns", "advantages"} <= ref.keys() and not {"prox_logp", "ref_logp"} & ref.keys()
    p0 = _params(models.policy)
    metrics, applied = update(cfg, models, batch, ref, train_policy=False)
    assert applied and "value_loss" in metrics and "policy_loss" not in metrics
    assert all(torch.equal(v, p0[k]) for k, v in _params(models.policy).items())


def test_sharded_update_refuses_references_left_to_it(tmp_path, policy0):
    from learner.trainer.ranks import Shard
    cfg = make_cfg(tmp_path)
    models, batch = build_models(cfg), collate(synthetic_trajectories(policy0, 4))
    shard = Shard(index=torch.arange(2), real=torch.ones(2, dtype=torch.bool), world=2, group=None)
    with pytest.raises(ValueError, match="each rank scores only its rows"):
        update(cfg, models, batch, prepare(cfg, models, batch, values_from_update=True), True, shard)


def test_file_source_offsets_bad_and_partial_lines(tmp_path, policy0):
    t = synthetic_trajectories(policy0, 3)
    path = write_trajectories(tmp_path / "f.jsonl", t[:2], append=False)
    with path.open("ab") as f:
        f.write(b'{"not": "a trajectory"}\n')
        f.write(b'{"v":1,"traj_id"')  # a line still being written
    src = FileSource(path)
    got = src.poll(10, 0.0)
    assert [x.task_id for x, _ in got] == [t[0].task_id, t[1].task_id] and src.bad_lines == 1
    assert src.exhausted
    resume_at = got[0][1].next
    write_trajectories(path, [])  # nothing new: the partial line is still not handed out
    src2 = FileSource(path)
    src2.seek({"file": resume_at})
    assert [x.task_id for x, _ in src2.poll(10, 0.0)] == [t[1].task_id]


# ---------------------------------------------------------------------- the update

def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_nan_batch_is_skipped_and_weights_stay_finite(tmp_path, policy0):
    cfg = make_cfg(tmp_path)
    models = build_models(cfg)
    t = synthetic_trajectories(policy0, 4)
    before_p, before_v = _params(models.policy), _params(models.value)
    for poison in ("old_logp", "returns"):
        batch = collate(t)
        ref = prepare(cfg, models, batch)
        if poison == "old_logp":
            batch.old_logp[0, t[0].loss_mask.index(1)] = math.nan  # NaN ratio -> NaN policy loss
        else:
            ref["returns"][1, t[1].loss_mask.index(1)] = math.inf  # inf value loss
        metrics, applied = update(cfg, models, batch, ref, train_policy=True)
        assert not applied
        assert all(torch.equal(v, before_p[k]) for k, v in models.policy.state_dict().items())
        assert all(torch.equal(v, before_v[k]) for k, v in models.value.state_dict().items())
        assert models.policy_opt.state_dict()["state"] == {}  # no optimizer step was taken
    # the clean batch then trains: weights move and stay finite
    batch = collate(t)
    metrics, applied = update(cfg, models, batch, prepare(cfg, models, batch), train_policy=True)
    assert applied and math.isfinite(metrics["policy_loss"]) and math.isfinite(metrics["value_loss"])
    changed = [k for k, v in models.policy.state_dict().items() if not torch.equal(v, before_p[k])]
    assert "model.embed_tokens.weight" in changed and "model.layers.0.self_attn.q_proj.weight" in changed
    assert all(torch.isfinite(p).all() for p in models.policy.parameters())


def test_trainer_drops_invalid_and_duplicates_from_a_bus(tmp_path, policy0):
    # the in-memory bus carries msgpack, which (unlike JSON) can hold a NaN reward
    bus = MemoryBus()
    prod = bus.producer()
    t = synthetic_trajectories(policy0, 8)
    for x in t[:4] + [with_(t[0], traj_id="resent"), with_(t[4], reward=math.nan)] + t[5:]:
        prod.send("r.trajectories", x, key=x.task_id)
    cfg = make_cfg(tmp_path, "batch.max_trajectories=7", "batch.tokens=100000")
    trainer, events = make_trainer(cfg, BusSource(bus.consumer({"r.trajectories": Trajectory})))
    trainer.start()
    trainer.step_once()
    assert sorted(events[0].task_ids) == sorted(x.task_id for x in t[:4] + t[5:])
    # the NaN reward is refused when it is decoded (Trajectory.validate): dead-lettered, never admitted
    assert trainer.admission.counts == Counter(ok=7, duplicate=1) and trainer.source.dead_letters == 1
    assert events[0].metrics["learner/count_duplicate"] == 1.0 and not events[0].skipped


def test_optimizer_state_flattens_without_pickle():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.tensor([1.0, -2.0, 3.0])
    opt.step()
    tensors, meta = flatten_optimizer(opt)
    assert set(tensors) == {"state/0/step", "state/0/exp_avg", "state/0/exp_avg_sq"}
    q = torch.nn.Parameter(torch.ones(3))
    opt2 = torch.optim.AdamW([q], lr=0.5)
    unflatten_optimizer(opt2, tensors, meta)
    assert opt2.param_groups[0]["lr"] == 0.1 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    assert torch.equal(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"])


def test_checkpoint_round_trip_gives_identical_next_step(tmp_path, policy0):
    trajs = synthetic_trajectories(policy0, 30)
    cfg = make_cfg(tmp_path, "batch.tokens=80", "optim.lr=0.01")
    a, ev_a = make_trainer(cfg, file_source(tmp_path, trajs))
    a.start()
    for _ in range(2):
        a.step_once()
    a.checkpoint()  # the whole file has been read: the unread rest of it lives in the buffer
    assert len(a.batcher.pending()) > 0
    a.step_once()
    # a fresh learner with different initial weights resumes from the checkpoint
    cfg_b = make_cfg(tmp_path, "batch.tokens=80", "optim.lr=0.01", "seed=7")
    b, ev_b = make_trainer(cfg_b, file_source(tmp_path, trajs))
    assert b.resume() and b.step == 2
    b.start()
    b.step_once()
    assert ev_b[0].task_ids == ev_a[2].task_ids
    perf = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert perf(ev_b[0].metrics) == perf(ev_a[2].metrics)
    for name in ("policy", "value"):
        sa, sb = getattr(a.models, name).state_dict(), getattr(b.models, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a.models.policy_opt.state_dict()["state"][0]["exp_avg"],
                       b.models.policy_opt.state_dict()["state"][0]["exp_avg"])


# ---------------------------------------------------------------------- versions, staleness, modes

def test_staleness_drops_and_versions_published(tmp_path, policy0):
    trajs = synthetic_trajectories(policy0, 16, version=0)
    cfg = make_cfg(tmp_path, "batch.max_trajectories=4", "batch.tokens=100000", "batch.max_staleness=1")
    pub = DirectoryPublisher(tmp_path / "weights")
    trainer, events = make_trainer(cfg, file_source(tmp_path, trajs), pub)
    trainer.run()
    # v0 published at start; step 1 trains 4 at staleness 0 -> v1; step 2 at staleness 1 -> v2;
    # the 8 left are 2 versions behind v2 and dropped
    assert [e.staleness for e in events] == [{"0": 4}, {"1": 4}]
    assert trainer.admission.counts["stale"] == 8 and trainer.version == 2
    assert pub.versions() == [0, 1, 2]
    store = WeightStore(tmp_path / "weights")
    sd = store.load(store.latest())  # sha256-verified, as an agent loads it
    assert torch.equal(sd["model.embed_tokens.weight"], trainer.models.policy.model.embed_tokens.weight)
    assert latest_checkpoint(cfg.checkpoint.dir).name == "step_00000002"


def test_the_weight_store_keeps_only_the_newest_versions(tmp_path, policy0):
    trajs = synthetic_trajectories(policy0, 16, version=0)
    cfg = make_cfg(tmp_path, "batch.max_trajectories=4", "batch.tokens=100000", "batch.max_staleness=8")
    pub = DirectoryPublisher(tmp_path / "weights", keep=2)
    trainer, _ = make_trainer(cfg, file_source(tmp_path, trajs), pub)
    trainer.run()
    assert trainer.version == 4 and pub.versions() == [3, 4]  # v0..v2 deleted as v3, v4 arrived
    store = WeightStore(tmp_path / "weights")
    assert store.load(store.latest())["model.embed_tokens.weight"].shape[0] > 0
    assert store.prune(0) == [] and pub.versions() == [3, 4]  # keep 0: keep all


def test_sync_mode_trains_only_the_current_version(tmp_path, policy0):
    v0, late, v1, v2 = (synthetic_trajectories(policy0, n, seed=s, version=v)
                        for n, s, v in ((4, 0, 0), (2, 1, 0), (4, 2, 1), (4, 3, 2)))
    cfg = make_cfg(tmp_path, "batch.sync=true", "batch.sync_batch=4")
    trainer, events = make_trainer(cfg, file_source(tmp_path, v0 + late + v1 + v2), DirectoryPublisher(tmp_path / "w"))
    trainer.run()
    assert [e.staleness for e in events] == [{"0": 4}] * 3
    assert [sorted(e.task_ids) for e in events] == [sorted(x.task_id for x in b) for b in (v0, v1, v2)]
    assert trainer.counters["stale"] == 2 and trainer.version == 3


def test_sync_mode_publishes_a_version_after_a_critic_only_step(tmp_path, policy0):
    # sync agents answer one batch per version and then wait: warm-up step 1 (critic only) must still
    # publish v1, or no v1 trajectories would ever come. Batches of 4: v0 -> warm-up -> v1 -> policy step -> v2.
    v0, v1 = (synthetic_trajectories(policy0, 4, seed=s, version=v) for s, v in ((0, 0), (1, 1)))
    cfg = make_cfg(tmp_path, "batch.sync=true", "batch.sync_batch=4", "value.warmup_steps=1")
    pub = DirectoryPublisher(tmp_path / "w")
    trainer, events = make_trainer(cfg, file_source(tmp_path, v0 + v1), pub)
    p0 = _params(trainer.models.policy)
    trainer.run()
    assert [e.staleness for e in events] == [{"0": 4}] * 2
    assert pub.versions() == [0, 1, 2] and trainer.version == 2
    v1_weights = WeightStore(tmp_path / "w").load(WeightStore(tmp_path / "w").versions()[1])
    assert all(torch.equal(v1_weights[k], p0[k]) for k in v1_weights)  # v1: the unchanged policy


def test_group_estimator_trains_complete_groups_without_critic(tmp_path, policy0):
    g = synthetic_trajectories(policy0, 12, group_size=4)  # 3 groups of 4
    order = [g[i] for i in (0, 4, 1, 5, 2, 6, 3, 7, 8, 9)]  # the third group never completes
    cfg = make_cfg(tmp_path, "advantage.estimator=grpo", "advantage.group_size=4", "loss.name=dapo",
                   "batch.tokens=1")
    trainer, events = make_trainer(cfg, file_source(tmp_path, order))
    assert trainer.models.value is None
    trainer.run()
    assert [set(e.task_ids) for e in events] == [{g[0].task_id}, {g[4].task_id}]
    assert all(len(e.task_ids) == 4 for e in events)
    assert len(trainer.batcher.pending()) == 2  # the incomplete group waits (and is checkpointed)


@pytest.mark.parametrize("critic", [[], ["value.kind=head"], ["value.kind=head", "value.detach_backbone=false"]],
                         ids=["copy", "head", "head-joint"])
def test_value_warmup_is_critic_only(tmp_path, policy0, critic):
    cfg = make_cfg(tmp_path, "value.warmup_steps=2", "batch.max_trajectories=4", "batch.tokens=100000", *critic)
    trainer, events = make_trainer(cfg, file_source(tmp_path, synthetic_trajectories(policy0, 12)),
                                   DirectoryPublisher(tmp_path / "w"))
    p0 = _params(trainer.models.policy)
    trainer.start()
    trainer.step_once()
    assert all(torch.equal(v, p0[k]) for k, v in trainer.models.policy.state_dict().items())
    trainer.step_once()
    trainer.step_once()
    assert [e.metrics["learner/value_warmup"] for e in events] == [1.0, 1.0, 0.0]
    assert "learner/policy_loss" not in events[0].metrics and "learner/policy_loss" in events[2].metrics
    assert [e.version for e in events] == [1, 2, 3]  # every step publishes (agents pace themselves on versions)


@pytest.mark.parametrize("override, field", [
    ("loss.name=grpo", "loss.name"), ("batch.tokens=0", "batch.tokens"), ("advantage.lam_actor=1.5", "lam_actor"),
    ("loss.agg=mean", "loss.agg"), ("advantage.estimator=rloo", "group_size"),
    ("loss.kl_coef=-0.1", "loss.kl_coef"), ("loss.kl_coef=inf", "loss.kl_coef"), ("loss.kl_type=k2", "loss.kl_type"),
    ("backend.name=megatron", "loss.kl_coef"),
])
def test_config_errors_name_the_field(tmp_path, override, field):
    extra = ["advantage.group_size=1"] if "rloo" in override else []
    extra += ["loss.kl_coef=0.1"] if "megatron" in override else []
    with pytest.raises(ConfigError, match=field):
        make_cfg(tmp_path, override, *extra)


@pytest.mark.parametrize("loss", ["sao", "ppo", "dual_clip", "dapo", "gspo", "cispo", "decoupled_ppo"])
def test_every_loss_trains_end_to_end(tmp_path, policy0, loss):
    cfg = make_cfg(tmp_path, f"loss.name={loss}", "optim.updates_per_batch=2", "batch.max_trajectories=6",
                   "batch.tokens=100000", "advantage.adaptive_alpha=0.05", "advantage.batch_norm=true")
    trainer, events = make_trainer(cfg, file_source(tmp_path, synthetic_trajectories(policy0, 6)))
    p0 = _params(trainer.models.policy)
    trainer.run()
    m = events[0].metrics
    assert len(events) == 1 and not events[0].skipped
    for key in ("policy_loss", "value_loss", "clip_frac_low", "clip_frac_high", "kl_k3", "entropy", "grad_norm",
                "explained_variance", "ratio_mean"):
        assert math.isfinite(m[f"learner/{key}"]), key
    # the second gradient step sees the first one's change: the ratio has left 1
    assert m["learner/ratio_mean"] != 1.0 and m["learner/kl_k3"] > 0
    assert not torch.equal(trainer.models.policy.lm_head.weight, p0["lm_head.weight"])


def test_value_loss_spike_re_enters_warmup(tmp_path):
    cfg = make_cfg(tmp_path, "value.rewarm_steps=3", "value.spike_factor=3", "value.spike_ema=0.5")
    trainer = Trainer(cfg, build_models(cfg), source=None)
    # running mean (decay 0.5): 1.0 -> 0.5·1.0 + 0.5·1.2 = 1.1 -> 0.5·1.1 + 0.5·0.9 = 1.0
    for v in (1.0, 1.2, 0.9):
        trainer._watch_value_loss(v, warm=False)
    assert trainer.warm_left == 0
    trainer._watch_value_loss(2.9, warm=False)  # 2.9 < 3 x 1.0: no spike; mean -> 1.95
    assert trainer.warm_left == 0
    trainer._watch_value_loss(10.0, warm=False)  # 10 > 3 x 1.95 = 5.85: spike
    assert trainer.warm_left == 3 and trainer.counters["rewarms"] == 1


def test_half_written_checkpoint_is_ignored(tmp_path, policy0):
    cfg = make_cfg(tmp_path, "batch.max_trajectories=4", "batch.tokens=100000")
    trainer, _ = make_trainer(cfg, file_source(tmp_path, synthetic_trajectories(policy0, 8)))
    trainer.start()
    trainer.step_once()
    trainer.checkpoint()
    # a kill during the next save leaves a temporary directory with some files and no state.json
    half = tmp_path / "ck" / ".tmp-step_00000002-999"
    half.mkdir()
    (half / "policy.safetensors").write_bytes(b"partial")
    again, _ = make_trainer(cfg, file_source(tmp_path, []))
    assert again.resume() and again.step == 1 and not half.exists()
    assert len(again.batcher.pending()) == 4


def test_cli_config_errors_and_print(capsys):
    from learner.train import main

    assert main(["--set", "loss.name=nope"]) == 2
    assert "loss.name" in capsys.readouterr().err
    assert main(["--print-config", "--loss", "cispo", "--sync"]) == 0
    out = capsys.readouterr().out
    assert '"name": "cispo"' in out and '"sync": true' in out


def test_trainer_skips_a_step_whose_loss_overflows(tmp_path, policy0):
    # reward 1e38 is refused when decoded (streamer.wire.schema.Limits); a batch holding it, handed to the update
    # directly, still overflows the squared value error to inf, and the step is skipped
    t = synthetic_trajectories(policy0, 12)
    bad = t[4:8]
    bad[1] = with_(bad[1], reward=1e38)
    cfg = make_cfg(tmp_path, "batch.max_trajectories=4", "batch.tokens=100000")
    trainer, events = make_trainer(cfg, file_source(tmp_path, t[:4] + t[8:]))
    trainer.start()
    trainer.step_once()
    after_first = _params(trainer.models.policy), _params(trainer.models.value)
    skipped = trainer.train_on(bad)
    assert skipped.skipped and skipped.metrics["learner/count_skipped_steps"] == 1.0
    for model, before in zip((trainer.models.policy, trainer.models.value), after_first):
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    trainer.step_once()
    assert not events[1].skipped
    assert all(torch.isfinite(p).all() for p in trainer.models.value.parameters())
    assert not torch.equal(trainer.models.policy.lm_head.weight, after_first[0]["lm_head.weight"])


# ---------------------------------------------------------------------- KL penalty to the initial policy

def test_kl_penalty_to_the_initial_policy(tmp_path, policy0):
    trajs = synthetic_trajectories(policy0, 24)
    # off by default: no reference model, no metric
    cfg0 = make_cfg(tmp_path, "batch.max_trajectories=4", "batch.tokens=100000", "value.warmup_steps=0")
    t0, ev0 = make_trainer(cfg0, file_source(tmp_path, trajs[:4], "off.jsonl"))
    assert t0.models.reference is None
    t0.run()
    assert "learner/kl_ref" not in ev0[0].metrics
    # on: a frozen copy of the initial policy; 0 at the first step (policy == reference), > 0 once it moved
    cfg = make_cfg(tmp_path, "batch.max_trajectories=4", "batch.tokens=100000", "value.warmup_steps=0",
                   "optim.lr=0.01", "loss.kl_coef=0.5", "checkpoint.every=3")
    trainer, events = make_trainer(cfg, file_source(tmp_path, trajs))
    ref = trainer.models.reference
    assert ref is not None and not ref.training and not any(p.requires_grad for p in ref.parameters())
    p0 = _params(trainer.models.policy)
    trainer.run()
    kl = [e.metrics["learner/kl_ref"] for e in events]
    assert len(kl) == 6 and not any(e.skipped for e in events), kl
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and all(k > 0 for k in kl[2:]), kl
    assert all(math.isfinite(e.metrics["learner/policy_loss"]) for e in events)
    assert all(torch.equal(v, p0[k]) for k, v in ref.state_dict().items())  # the reference never trains
    assert not torch.equal(trainer.models.policy.lm_head.weight, p0["lm_head.weight"])
    # resume: the policy comes from the checkpoint, the reference is still the initial policy
    b, _ = make_trainer(cfg, file_source(tmp_path, trajs))
    assert b.resume() and b.step == 6
    assert all(torch.equal(v, p0[k]) for k, v in b.models.reference.state_dict().items())
    sa, sb = trainer.models.policy.state_dict(), b.models.policy.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("loss", ["sao", "ppo", "dual_clip", "dapo", "gspo", "cispo", "decoupled_ppo"])
@pytest.mark.parametrize("kind", ["k1", "k3", "forward"])
def test_every_loss_takes_the_kl_penalty(tmp_path, policy0, loss, kind):
    cfg = make_cfg(tmp_path, f"loss.name={loss}", f"loss.kl_type={kind}", "loss.kl_coef=0.1", "value.warmup_steps=0",
                   "optim.updates_per_batch=2", "batch.max_trajectories=6", "batch.tokens=100000")
    trainer, events = make_trainer(cfg, file_source(tmp_path, synthetic_trajectories(policy0, 6)))
    trainer.run()
    m = events[0].metrics
    assert len(events) == 1 and not events[0].skipped
    assert math.isfinite(m["learner/policy_loss"]) and math.isfinite(m["learner/kl_ref"])
    assert m["learner/kl_ref"] != 0.0  # the second update moved the policy away from the reference


def test_next_token_logprobs_hold_the_sampled_tokens_log_probs(policy0):
    from learner.models.scoring import next_token_logprobs, token_logprobs

    trajs = synthetic_trajectories(policy0, 3)
    batch = collate(trajs)
    ids, attn = batch.input_ids, batch.attention_mask
    full = next_token_logprobs(policy0, ids, attn, 0.7)
    picked = token_logprobs(policy0, ids, attn, 0.7)
    scored = picked != 0
    assert full.shape == (*ids.shape, policy0.config.vocab_size) and int(scored.sum()) > 0
    # the sampled token's entry is token_logprobs', each scored row a distribution, zeros where nothing is scored
    assert torch.allclose(full.gather(-1, ids.unsqueeze(-1)).squeeze(-1), picked, atol=1e-6)
    assert torch.allclose(full.exp().sum(-1)[scored], torch.ones(int(scored.sum())), atol=1e-5)
    assert bool((full[~scored] == 0).all())

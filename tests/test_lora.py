"""LoRA on the policy (learner.policy.lora) and the value head (learner.value.kind=head) in the real learner:
only the adapters train and hold optimizer state, a published version (merged weights) loaded the way an agent
loads it answers as the learner's LoRA model does, and a checkpoint resumes both options to identical weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from learner.engines.hf_engine import HFEngine  # noqa: E402
from learner.models.lora import has_lora, merged_state_dict  # noqa: E402
from learner.models.policy import build_policy, load_policy, save_policy  # noqa: E402
from learner.models.scoring import token_logprobs  # noqa: E402
from learner.models.tokenizer import CharTokenizer  # noqa: E402
from learner.models.value import ValueHead  # noqa: E402
from learner.train import build_models, build_outputs  # noqa: E402
from learner.trainer.publish import DirectoryPublisher  # noqa: E402
from learner.trainer.synthetic import synthetic_trajectories, tiny_model_config  # noqa: E402
from streamer.agent.agent import load_engine  # noqa: E402
from streamer.transport.weights import WeightStore  # noqa: E402
from streamer.wire.config import ConfigError  # noqa: E402
from streamer.wire.settings import AgentSettings  # noqa: E402
from tests.test_trainer import file_source, make_cfg, make_trainer  # noqa: E402

LORA = ["policy.lora.r=4", "policy.lora.alpha=8"]


@pytest.fixture(scope="module")
def policy0():
    return build_policy(tiny_model_config(), seed=0)


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def test_only_the_adapters_train_and_hold_optimizer_state(tmp_path, policy0):
    trajs = synthetic_trajectories(policy0, 12)
    trainer, events = make_trainer(make_cfg(tmp_path, *LORA, "optim.lr=0.01", "batch.max_trajectories=4",
                                            "batch.tokens=100000"), file_source(tmp_path, trajs))
    policy, opt = trainer.models.policy, trainer.models.policy_opt
    assert has_lora(policy)
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == \
        {id(p) for p in policy.parameters() if p.requires_grad}
    frozen = {k: v.clone() for k, v in policy.state_dict().items() if ".lora_" not in k}
    trainer.run()
    assert len(events) == 3 and not any(e.skipped for e in events)
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # the base weights never move
    assert all(after[k].abs().sum() > 0 for k in after if ".lora_B." in k)  # B starts at 0: it has learnt
    n_lora = sum(policy.get_parameter(n).numel() for n in trained)
    # hand count: r=4 adapters on q, k, v, o of the one layer (32 -> 2x16 q, 16 k, 16 v; o 32 -> 32)
    q, kv, o = 4 * (32 + 32), 4 * (32 + 16), 4 * (32 + 32)
    assert n_lora == q + 2 * kv + o
    assert optimizer_state_bytes(opt) == 2 * 4 * n_lora  # exp_avg + exp_avg_sq, fp32


def test_an_agent_loading_the_published_version_answers_as_the_learner_model(tmp_path, policy0):
    trajs = synthetic_trajectories(policy0, 12)
    pub = DirectoryPublisher(tmp_path / "weights")
    trainer, events = make_trainer(make_cfg(tmp_path, *LORA, "optim.lr=0.02", "batch.max_trajectories=4",
                                            "batch.tokens=100000"), file_source(tmp_path, trajs), pub)
    trainer.run()
    assert pub.versions() == [0, 1, 2, 3]
    store = WeightStore(tmp_path / "weights")
    published = store.load(store.latest())
    plain = DirectoryPublisher(tmp_path / "plain").publish(policy0, 0, 0)
    assert set(published) == set(WeightStore(tmp_path / "plain").load(plain))  # the HF names, as without LoRA
    engine, _ = load_engine(AgentSettings(weights_dir=str(store.root), engine="torch"), store)  # as agents do
    assert engine.version == 3
    assert_answers_as(engine, trainer.models.policy, [t.tokens[:t.prompt_len] for t in trajs[:4]])


def assert_answers_as(engine, policy, prompts):
    """`engine`'s greedy answers are the learner's LoRA `policy`'s, their log-probs its own within 1e-5, and they
    moved more than 1e-3 from the base policy's (so the comparison is not vacuous)."""
    policy = policy.eval()
    agent = engine.generate(prompts, max_new_tokens=8, temperature=0.0)
    learner = HFEngine(policy, CharTokenizer()).generate(prompts, max_new_tokens=8, temperature=0.0)
    assert [g.token_ids for g in agent] == [g.token_ids for g in learner]
    base = build_policy(tiny_model_config(), seed=0)
    moved = 0.0
    for p, g in zip(prompts, agent):
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            mine = token_logprobs(policy, ids)[0, len(p):]
            before = token_logprobs(base, ids)[0, len(p):]
        assert mine.tolist() == pytest.approx(g.logprobs, abs=1e-5)
        moved = max(moved, float((mine - before).abs().max()))
    assert moved > 1e-3  # the adapters changed the answers' log-probs: the comparison above is not vacuous


def test_merged_weights_equal_base_plus_scaled_product(tmp_path):
    cfg = make_cfg(tmp_path, *LORA)
    policy = build_models(cfg).policy
    layer = policy.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    merged = merged_state_dict(policy)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer.weight + (b @ a) * (8 / 4)  # alpha / r
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6)
    x = torch.randn(3, 32)
    assert torch.allclose(layer(x), x @ merged["model.layers.0.self_attn.q_proj.weight"].t(), atol=1e-5)


@pytest.mark.parametrize("options", [LORA, ["value.kind=head"],
                                     [*LORA, "value.kind=head", "value.detach_backbone=false"]],
                         ids=["lora", "head", "lora+head-joint"])
def test_checkpoint_resume_gives_identical_weights(tmp_path, policy0, options):
    trajs = synthetic_trajectories(policy0, 30)
    cfg = make_cfg(tmp_path, "batch.tokens=80", "optim.lr=0.01", *options)
    a, ev_a = make_trainer(cfg, file_source(tmp_path, trajs))
    a.start()
    for _ in range(2):
        a.step_once()
    a.checkpoint()
    a.step_once()
    b, ev_b = make_trainer(make_cfg(tmp_path, "batch.tokens=80", "optim.lr=0.01", "seed=7", *options),
                           file_source(tmp_path, trajs))
    assert b.resume() and b.step == 2
    b.start()
    b.step_once()
    assert ev_b[0].task_ids == ev_a[2].task_ids
    for name in ("policy", "value"):
        sa, sb = getattr(a.models, name).state_dict(), getattr(b.models, name).state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
    if "value.kind=head" in options:
        assert isinstance(b.models.value, ValueHead) and set(b.models.value.state_dict()) == {"head.weight",
                                                                                                "head.bias"}
        assert b.models.value.backbone is b.models.policy.model  # still the policy's own backbone after resume


@pytest.mark.parametrize("override, field", [
    ("policy.lora.r=-1", "policy.lora"), ("value.kind=twin", "value.kind"),
    ("policy.lora.dropout=1.5", "policy.lora"), ("policy.lora.publish=adapters", "policy.lora.publish"),
    ("value.layers=1", "value.kind"),
])
def test_bad_options_name_the_field(tmp_path, override, field):
    setting = {"dropout": "policy.lora.r=4", "layers": "value.kind=head"}
    with pytest.raises(ConfigError, match=field):
        make_cfg(tmp_path, next((v for k, v in setting.items() if k in override), "seed=0"), override)


def test_unknown_target_module_is_named(tmp_path):
    with pytest.raises(ValueError, match="gate_up_proj"):
        build_models(make_cfg(tmp_path, "policy.lora.r=4", "policy.lora.target_modules=[gate_up_proj]"))


@pytest.mark.parametrize("arch", ["qwen3", "glm4_moe"])
def test_lora_and_a_joint_head_on_the_own_model_archs(tmp_path, arch):
    """The HF forward (not the packed one): a dense Qwen3 and a GLM-4-MoE (attention bias) from learner.models.toy."""
    from learner.models.toy import build_toy_model
    from learner.trainer.batching import collate
    from learner.trainer.step import prepare, update

    model_dir = build_toy_model(arch, ["hello world answer yes", "bonjour le monde oui", "1 + 2 = 3"] * 5,
                                tmp_path / arch, vocab_size=300)
    cfg = make_cfg(tmp_path, f"io.init={model_dir}", *LORA, "value.kind=head", "value.detach_backbone=false",
                   "optim.lr=0.05")
    models = build_models(cfg)
    trajs = synthetic_trajectories(models.policy, 8)
    batch = collate(trajs)
    for _ in range(2):
        assert update(cfg, models, batch, prepare(cfg, models, batch), True)[1]
    fresh = load_policy(model_dir)
    fresh.load_state_dict(merged_state_dict(models.policy))
    ids = torch.tensor([trajs[0].tokens])
    with torch.no_grad():
        live, merged, base = models.policy.eval()(ids).logits, fresh(ids).logits, load_policy(model_dir)(ids).logits
    assert torch.allclose(live, merged, atol=1e-5) and (live - base).abs().max() > 1e-3


def test_adapter_versions_merged_by_an_agent_on_the_base_answer_as_the_learner(tmp_path, policy0):
    base_dir = save_policy(policy0, tmp_path / "base", CharTokenizer())
    trajs = synthetic_trajectories(policy0, 12)
    cfg = make_cfg(tmp_path, *LORA, "policy.lora.publish=adapters", "optim.lr=0.02", "batch.max_trajectories=4",
                   "batch.tokens=100000", f"io.weights_dir={tmp_path / 'weights'}", "io.trajectories=t.jsonl")
    pub, _, closers = build_outputs(cfg)  # the learner's own publisher (no broker: io.trajectories is set)
    trainer, _ = make_trainer(cfg, file_source(tmp_path, trajs), pub)
    trainer.run()
    for close in closers:
        close()
    store = WeightStore(tmp_path / "weights")
    pv = store.latest()
    assert pv.version == 3
    merged = DirectoryPublisher(tmp_path / "merged").publish(trainer.models.policy, 3, 3)
    size = lambda p: (Path(store.resolve(p) if p is pv else p.uri) / "model.safetensors").stat().st_size  # noqa: E731
    assert size(pv) * 5 < size(merged)  # the adapters alone (the tiny model: 4.9 kB against 49 kB)
    engine, _ = load_engine(AgentSettings(model=str(base_dir), weights_dir=str(store.root), engine="torch"), store)
    engine.load_state_dict(store.load(store.versions()[2]), 2)  # an older version first: each merges onto the base
    engine.load_state_dict(store.load(pv), pv.version)
    assert_answers_as(engine, trainer.models.policy, [t.tokens[:t.prompt_len] for t in trajs[:4]])
    with pytest.raises(ValueError, match="adapters alone"):  # never loaded as a model (its base would be random)
        load_policy(store.resolve(pv))
    other = save_policy(build_policy(tiny_model_config(), seed=1), tmp_path / "other", CharTokenizer())
    stranger, _ = load_engine(AgentSettings(model=str(other), weights_dir=str(store.root), engine="hf"), store)
    before = {k: v.clone() for k, v in stranger.model.state_dict().items()}
    with pytest.raises(ValueError, match="other base weights"):
        stranger.load_state_dict(store.load(pv), pv.version)
    assert all(torch.equal(v, before[k]) for k, v in stranger.model.state_dict().items())


def test_the_kl_reference_under_lora_is_the_base_without_a_copy(tmp_path, policy0):
    trajs = synthetic_trajectories(policy0, 12)
    trainer, events = make_trainer(make_cfg(tmp_path, *LORA, "loss.kl_coef=0.1", "optim.lr=0.02",
                                            "batch.max_trajectories=4", "batch.tokens=100000"),
                                   file_source(tmp_path, trajs))
    reference, policy = trainer.models.reference, trainer.models.policy
    assert list(reference.parameters()) == []  # no second copy of the model
    trainer.run()
    assert events[-1].metrics["learner/kl_ref"] > 0  # the trained policy has left the reference
    ids = torch.tensor([trajs[0].tokens])
    with torch.no_grad():
        assert torch.allclose(token_logprobs(reference, ids), token_logprobs(policy0, ids), atol=1e-5)
        assert (token_logprobs(policy, ids) - token_logprobs(policy0, ids)).abs().max() > 1e-3  # adapters back on
    assert all(p.requires_grad == (".lora_" in n) for n, p in policy.named_parameters())

"""Tiny MoE policy and value model: sizes, padding invariance, save/load, routing, scoring values."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.models import (
    CharTokenizer,
    ModelConfig,
    ValueModel,
    build_policy,
    count_params,
    expert_counts,
    load_policy,
    logprobs_and_entropy,
    router_logits,
    save_policy,
    token_entropy,
    token_logprobs,
    values,
)
from learner.models.packed import packable
from learner.models.scoring import hf_policy_logits, policy_logits, position_ids_from_mask, predictor_positions

V = CharTokenizer().vocab_size


@pytest.fixture(scope="module")
def policy():
    return build_policy(seed=0)


@pytest.fixture(scope="module")
def value_model(policy):
    return ValueModel.from_policy(policy, seed=1)


def _batch(lengths, seed=0, left=False):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows = [torch.randint(4, V, (n,), generator=g) for n in lengths]
    for i, r in enumerate(rows):
        sl = slice(T - len(r), T) if left else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask, rows


def test_default_size_matches_calibration(policy):
    # Per layer: q 128*128 + k 128*64 + v 128*64 + o 128*128 = 49,152; q/k norms 2*32; two layer norms 2*128;
    # router 8*128 = 1,024; experts 8 * 3 * 128*256 = 786,432 -> 836,928. Four layers 3,347,712, final norm 128,
    # tied embedding V*128 (counted once).
    assert count_params(policy) == 4 * 836_928 + 128 + V * 128
    assert policy.config.tie_word_embeddings and policy.lm_head.weight is policy.model.embed_tokens.weight
    assert policy.dtype == torch.float32 and policy.config.output_router_logits is False


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelConfig(experts_per_token=9)


def test_uniform_model_logprob_and_entropy_by_hand():
    # Zero embedding (tied, so also a zero lm_head): every hidden state is 0, so every logit is 0 and each
    # next-token distribution is uniform over V tokens: log-prob -log V, entropy log V. Token 0 has no context: 0.
    model = build_policy(seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
    ids, mask, _ = _batch([5, 3])
    lp, ent = logprobs_and_entropy(model, ids, mask)
    expected = torch.tensor([[0.0] + [-math.log(V)] * 4, [0.0, -math.log(V), -math.log(V), 0.0, 0.0]])
    torch.testing.assert_close(lp, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, -expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("left", [False, True])
def test_padding_does_not_change_valid_positions(policy, value_model, left):
    ids, mask, rows = _batch([9, 4, 1, 7], left=left)
    lp = token_logprobs(policy, ids, mask)
    ent = token_entropy(policy, ids, mask)
    val = values(value_model, ids, mask)
    for i, r in enumerate(rows):
        real = mask[i].bool()
        alone = r[None]
        torch.testing.assert_close(lp[i, real], token_logprobs(policy, alone)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, real], token_entropy(policy, alone)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(val[i, real], values(value_model, alone)[0], atol=1e-5, rtol=0)
        assert torch.all(lp[i, ~real] == 0) and torch.all(val[i, ~real] == 0)


@pytest.mark.parametrize("left", [False, True])
def test_packed_scoring_equals_the_hf_forward(policy, value_model, left):
    """policy_logits and values take the packed forward (learner.models.packed) for this model: the HF forward's
    logits, values and gradients at every real token, on rows of other lengths and either padding side."""
    ids, mask, _ = _batch([9, 4, 1, 7, 12, 3], seed=3, left=left)
    real = mask.bool()
    assert packable(policy.model) and packable(value_model.backbone)
    pol = build_policy(seed=0).train()
    weights = torch.randn(*ids.shape, V, generator=torch.Generator().manual_seed(5))
    grads = []
    for fn in (policy_logits, hf_policy_logits):
        pol.zero_grad(set_to_none=True)
        logits = fn(pol, ids, mask)
        (logits * weights * mask[..., None]).sum().backward()
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in pol.parameters()])
        if fn is policy_logits:
            packed = logits.detach()
            assert torch.all(packed[~real] == 0)
        else:
            torch.testing.assert_close(packed[real], logits.detach()[real], atol=2e-5, rtol=0)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    with torch.no_grad():
        hf_values = value_model(ids, mask, position_ids_from_mask(mask))
        torch.testing.assert_close(values(value_model, ids, mask)[real], hf_values[real], atol=2e-5, rtol=0)


def test_predictor_positions_by_hand():
    # token t is predicted at position t - 1: scored tokens 1, 2 of row 0 and 3 of row 1
    scored = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 1]], dtype=torch.float32)
    assert predictor_positions(scored).tolist() == [[True, True, False, False], [False, False, True, False]]
    assert predictor_positions(None) is None


@pytest.mark.parametrize("left", [False, True])
def test_scoring_only_the_scored_tokens_changes_nothing_there(value_model, left):
    """With `scored` (the trainer passes its loss mask) the packed forward runs its last layer on the scored tokens'
    predecessors alone: log-probs, entropies, next-token log-probs and their gradients equal the full forward's at
    the scored tokens, every other token gets 0; `values(..., at=)` likewise (a row with nothing scored included)."""
    ids, mask, _ = _batch([9, 4, 6, 7, 12, 3], seed=4, left=left)
    g = torch.Generator().manual_seed(6)
    scored = mask.bool() & (torch.rand(ids.shape, generator=g) < 0.4)
    scored[:, :1] = False  # never a row's first slot (the loss mask never holds it)
    scored[2] = False  # a row with nothing to score
    pol = build_policy(seed=0).train()
    w = torch.randn(*ids.shape, generator=g)
    outs, grads = [], []
    for given in (None, scored):
        pol.zero_grad(set_to_none=True)
        lp, ent, full = logprobs_and_entropy(pol, ids, mask, 0.7, full=True, scored=given)
        ((lp + ent + full.logsumexp(-1)) * w * scored).sum().backward()
        outs.append((lp.detach(), ent.detach(), full.detach()))
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in pol.parameters()])
    for every, only in zip(*outs):
        torch.testing.assert_close(only[scored], every[scored], atol=2e-5, rtol=0)
        assert torch.all(only[~scored] == 0)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(token_logprobs(pol, ids, mask, 0.7, scored), outs[1][0], atol=1e-6, rtol=0)
    with torch.no_grad():
        v_all, v_at = values(value_model, ids, mask), values(value_model, ids, mask, at=scored)
    torch.testing.assert_close(v_at[scored], v_all[scored], atol=2e-5, rtol=0)
    assert torch.all(v_at[~scored] == 0)


def test_scoring_only_the_scored_tokens_on_the_hf_forward_zeroes_the_rest():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    ids, mask, _ = _batch([5, 3, 4], seed=2)
    scored = torch.zeros_like(mask, dtype=torch.bool)
    scored[0, 2:4] = scored[2, 3] = True
    every, only = token_logprobs(dense, ids, mask), token_logprobs(dense, ids, mask, scored=scored)
    torch.testing.assert_close(only[scored], every[scored])
    assert torch.all(only[~scored] == 0) and torch.all(every[0, 1:5] != 0)


def test_packed_scoring_is_refused_where_it_does_not_apply(policy):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    assert not packable(dense.model)  # a dense model: the HF forward
    ids, mask, _ = _batch([3, 2])
    torch.testing.assert_close(policy_logits(dense, ids, mask), hf_policy_logits(dense, ids, mask))


def test_token_logprobs_is_differentiable(policy):
    ids, mask, _ = _batch([6, 6])
    model = build_policy(seed=0).train()
    token_logprobs(model, ids, mask).sum().backward()
    experts_with_grad = sum(
        int(e.gate_proj.weight.grad is not None and e.gate_proj.weight.grad.abs().sum() > 0)
        for layer in model.model.layers for e in layer.mlp.experts)
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0 and experts_with_grad > 0


def test_value_model_starts_from_policy_with_its_own_weights(policy):
    vm = ValueModel.from_policy(policy, seed=1)
    ids, mask, _ = _batch([5, 5])
    h_policy = policy.model(input_ids=ids, attention_mask=mask).last_hidden_state
    h_value = vm.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(h_value, h_policy, atol=0, rtol=0)
    with torch.no_grad():
        vm.backbone.embed_tokens.weight.add_(1.0)
    assert not torch.equal(vm.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert values(vm, ids, mask).std() > 0  # the fresh head is random, not zero


def test_a_shallower_critic_is_the_policys_first_layers_then_its_norm(policy, tmp_path):
    vm = ValueModel.from_policy(policy, seed=1, layers=2)
    assert policy.config.num_hidden_layers == 4 and len(vm.backbone.layers) == 2
    ids, mask, _ = _batch([6, 3], seed=4)
    with torch.no_grad():
        states = policy.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        want = policy.model.norm(states[2])  # after the first two blocks, through the policy's final norm
        got = vm.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        real = mask.bool()
        hf_values = vm(ids, mask, position_ids_from_mask(mask))
        torch.testing.assert_close(values(vm, ids, mask)[real], hf_values[real], atol=2e-5, rtol=0)  # packed path
    vm.save(tmp_path / "value")
    again = ValueModel.load(tmp_path / "value")
    assert len(again.backbone.layers) == 2
    torch.testing.assert_close(values(again, ids, mask), values(vm, ids, mask), atol=1e-6, rtol=0)
    for bad in (0, 5):
        with pytest.raises(ValueError, match=rf"value.layers: {bad}, the policy has 4 layers"):
            ValueModel.from_policy(policy, layers=bad)


def test_save_and_reload_give_identical_outputs(policy, value_model, tmp_path):
    tok = CharTokenizer()
    save_policy(policy, tmp_path / "policy", tok)
    value_model.save(tmp_path / "value")
    names = {p.name for p in (tmp_path / "policy").iterdir()} | {p.name for p in (tmp_path / "value").iterdir()}
    assert "model.safetensors" in names and not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    ids, mask, _ = _batch([8, 3])
    reloaded = load_policy(tmp_path / "policy")
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    # Same weights bit for bit; outputs agree to float rounding (the loaded tensors' memory layout differs).
    for k, w in policy.state_dict().items():
        assert torch.equal(w, reloaded.state_dict()[k]), k
    for m in (reloaded, auto):
        torch.testing.assert_close(token_logprobs(m, ids, mask), token_logprobs(policy, ids, mask), atol=1e-6, rtol=0)
    vm = ValueModel.load(tmp_path / "value")
    torch.testing.assert_close(values(vm, ids, mask), values(value_model, ids, mask), atol=1e-6, rtol=0)
    assert CharTokenizer.load(tmp_path / "policy").id_to_token == tok.id_to_token


def test_policy_and_value_dirs_are_not_confused(policy, value_model, tmp_path):
    save_policy(policy, tmp_path / "policy")
    value_model.save(tmp_path / "value")
    with pytest.raises(ValueError, match="value-model directory"):
        load_policy(tmp_path / "value")
    with pytest.raises(ValueError, match="not a value model"):
        ValueModel.load(tmp_path / "policy")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_policy(tmp_path / "missing")


def test_every_expert_receives_tokens(policy, value_model):
    ids, mask, _ = _batch([32] * 8, seed=3)
    for model in (policy, value_model):
        router = router_logits(model, ids, mask)
        counts = expert_counts(router, top_k=2, attention_mask=mask)
        assert counts.shape == (4, 8)
        assert torch.all(counts.sum(-1) == 2 * 8 * 32)  # each real token goes to exactly two experts per layer
        assert torch.all(counts > 0), counts


def test_saved_policy_dir_loads_with_auto_tokenizer(policy, tmp_path):
    tok = CharTokenizer()
    save_policy(policy, tmp_path / "p", tok)
    hf = AutoTokenizer.from_pretrained(tmp_path / "p")
    assert len(hf) == tok.vocab_size and (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    # Markup wins over its characters, unknown characters map to <unk>, whitespace and newlines are tokens.
    for text in ["abc 12+3=15\n", "<call>lookup(x)</call><obs> 42 </obs>", "Ab  \u00e9 x", "<ca<call>ll>"]:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)

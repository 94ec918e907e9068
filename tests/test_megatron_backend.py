"""Megatron-core backend: HF <-> megatron conversion, and parity with the HF/torch model under
torchrun (2 processes, gloo, expert parallelism 2 and 1), for both mapped architectures: the tiny
Qwen3-MoE of `ModelConfig` and a tiny random-init GLM-4-MoE built here (no hub download)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from learner.backends.megatron import convert  # noqa: E402
from learner.backends.megatron.model import check_supported  # noqa: E402
from learner.config import LearnerConfig  # noqa: E402
from learner.models.config import ModelConfig  # noqa: E402
from learner.models.policy import build_policy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def tiny_glm4_moe(seed: int = 0, **overrides):
    """A ~0.13M-parameter `Glm4MoeForCausalLM`: layer 0 dense, layers 1-2 MoE (4 routed experts, top-2,
    1 shared), qkv bias, half-rotary heads, qk norm, untied lm_head, a non-zero selection bias."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
                  attention_bias=True, partial_rotary_factor=0.5, use_qk_norm=True, tie_word_embeddings=False,
                  max_position_embeddings=64, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**fields, **overrides})).float().eval()
        with torch.no_grad():  # HF inits it to 0; N(0, 0.3) makes the biased choice differ from the unbiased one
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.3)
    return model


def _merge_ranks(sd, cfg, ep):
    merged = {}
    for r in range(ep):
        merged.update(convert.megatron_to_hf(convert.hf_to_megatron(sd, cfg, r, ep), cfg, r, ep))
    return merged


def _assert_round_trip(policy, ep):
    sd, cfg = policy.state_dict(), policy.config
    back = _merge_ranks(sd, cfg, ep)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_hf_megatron_hf_is_bit_identical(tie, ep):
    _assert_round_trip(build_policy(ModelConfig(tie_embeddings=tie), seed=3), ep)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "use_qk_norm": False, "attention_bias": False},
                                       {"first_k_dense_replace": 0, "n_shared_experts": 2}])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_glm4_moe_hf_megatron_hf_is_bit_identical(overrides, ep):
    _assert_round_trip(tiny_glm4_moe(seed=3, **overrides), ep)


def test_glm4_moe_layouts_follow_megatron_core():
    policy = tiny_glm4_moe(seed=1)
    sd, cfg = policy.state_dict(), policy.config
    ranks = [convert.hf_to_megatron(sd, cfg, ep_rank=r, ep_size=2) for r in (0, 1)]
    m = ranks[1]
    d = 16  # head_dim = 64 / 4; 2 KV groups of (2 query heads + k + v)
    qkv_b = m["decoder.layers.0.self_attention.linear_qkv.bias"]
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv")
    assert qkv_b.shape == (8 * d,)  # the bias follows the weight's per-group row layout
    assert torch.equal(qkv_b[0:2 * d], q[0:2 * d]) and torch.equal(qkv_b[2 * d:3 * d], k[0:d])
    assert torch.equal(qkv_b[4 * d:6 * d], q[2 * d:4 * d]) and torch.equal(qkv_b[7 * d:8 * d], v[d:2 * d])
    # layer 0 is dense (width intermediate_size); layers 1, 2 are MoE
    fc1 = m["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == (2 * 96, 64) and torch.equal(fc1[96:], sd["model.layers.0.mlp.up_proj.weight"])
    assert not any(n.startswith("decoder.layers.0.mlp.router") for n in m)
    assert torch.equal(m["decoder.layers.1.mlp.router.expert_bias"],
                       sd["model.layers.1.mlp.gate.e_score_correction_bias"])
    # shared experts (no gate in HF or megatron) are replicated on every EP rank; routed ones split
    shared = "decoder.layers.2.mlp.shared_experts.linear_fc1.weight"
    assert torch.equal(ranks[0][shared], ranks[1][shared])
    assert torch.equal(m[shared][:32], sd["model.layers.2.mlp.shared_experts.gate_proj.weight"])
    assert not any("gate_weight" in n for n in m) and not any("shared_expert_gate" in n for n in sd)
    assert torch.equal(m["decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"],
                       sd["model.layers.2.mlp.experts.3.down_proj.weight"])  # rank 1 holds experts 2, 3
    assert "decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight" not in m
    assert torch.equal(m["output_layer.weight"], sd["lm_head.weight"])  # untied


def test_megatron_layouts_follow_megatron_core():
    policy = build_policy(seed=1)
    sd, cfg = policy.state_dict(), policy.config
    m = convert.hf_to_megatron(sd, cfg, ep_rank=1, ep_size=2)
    d = 32  # head_dim = 128 / 4
    qkv = m["decoder.layers.0.self_attention.linear_qkv.weight"]
    # 2 KV groups of (2 query heads + k + v) = 2 * 4 * 32 rows; group 1 starts at row 4 * 32.
    assert qkv.shape == (256, 128)
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(qkv[0:2 * d], q[0:2 * d])  # query heads 0, 1 (group 0)
    assert torch.equal(qkv[2 * d:3 * d], k[0:d])
    assert torch.equal(qkv[3 * d:4 * d], v[0:d])
    assert torch.equal(qkv[4 * d:6 * d], q[2 * d:4 * d])  # query heads 2, 3 (group 1)
    assert torch.equal(qkv[7 * d:8 * d], v[d:2 * d])
    # EP rank 1 of 2 holds experts 4..7 as local 0..3; fc1 = [gate; up].
    fc1 = m["decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(fc1[:256], sd["model.layers.2.mlp.experts.4.gate_proj.weight"])
    assert torch.equal(fc1[256:], sd["model.layers.2.mlp.experts.4.up_proj.weight"])
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight" not in m
    assert "output_layer.weight" not in m  # tied embeddings


def test_unmapped_configs_are_refused_by_name():
    cfg = build_policy(seed=0).config
    cfg.mlp_only_layers = [1]
    with pytest.raises(ValueError, match="mlp_only_layers"):
        check_supported(cfg)
    cfg.model_type = "mixtral"
    with pytest.raises(ValueError, match="mixtral"):
        check_supported(cfg)
    from transformers import MixtralConfig

    with pytest.raises(ValueError, match="model_type 'mixtral' is not mapped"):
        check_supported(MixtralConfig())
    with pytest.raises(ValueError, match="expert_parallel=3"):
        convert.local_expert_range(8, 0, 3)


@pytest.mark.parametrize("field, value", [
    ("n_group", 2),  # HF scores groups by their top-2 and masks with 0.0; megatron by top-k/topk_group, -inf
    ("topk_group", 2),
    ("norm_topk_prob", False),  # megatron's sigmoid router always renormalises for k > 1
    ("num_experts_per_tok", 1),  # ... and never for k = 1
    ("n_shared_experts", 0),  # HF keeps a zero-width shared MLP
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("hidden_act", "gelu"),
])
def test_unmapped_glm4_moe_fields_are_refused_by_name(field, value):
    from transformers import Glm4MoeConfig

    cfg = tiny_glm4_moe().config
    check_supported(cfg)
    cfg = Glm4MoeConfig(**{**cfg.to_dict(), field: value})
    with pytest.raises(ValueError, match=f"glm4_moe config field '{field}'"):
        check_supported(cfg)


def test_attention_mask_is_causal_plus_key_padding():
    from learner.backends.megatron.model import attention_mask_4d, position_ids

    # one left-padded row [pad, a, b]: causal "may not attend" = strictly above the diagonal,
    # plus every query may not attend to key 0 (padding):
    #   q0: [T, T, T]   q1: [T, F, T]   q2: [T, F, F]
    m = attention_mask_4d(torch.tensor([[0, 1, 1]]))
    assert m.shape == (1, 1, 3, 3)
    assert m[0, 0].tolist() == [[True, True, True], [True, False, True], [True, False, False]]
    assert position_ids(torch.tensor([[0, 1, 1]])).tolist() == [[0, 0, 1]]  # as scoring's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# HF parameters whose gradients are compared: Qwen3-MoE 134 (lm_head tied to the embedding, counted once;
# the earlier count of 133 left it out though it was compared); GLM-4-MoE 71 = embed + norm + lm_head
# + 3 * 11 attention + 3 dense MLP + 2 * (router + 3 shared + 4 * 3 experts)
GRAD_TENSORS = {"qwen3_moe": 134, "glm4_moe": 71}


@pytest.fixture(scope="module", params=sorted(GRAD_TENSORS))
def parity(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron") / "parity.json"
    model = []
    if request.param == "glm4_moe":
        model_dir = tmp_path_factory.mktemp("glm4_moe")
        tiny_glm4_moe(seed=0).save_pretrained(model_dir)
        model = ["--model-dir", str(model_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "learner.backends.megatron.parity", "--out", str(out), "--ep", "2", *model]
    env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(out.read_text()), "arch": request.param}


@pytest.mark.slow  # the module's `parity` fixture: one 2-rank torchrun per arch, 12-14 s each on 2 cores
def test_ep2_and_ep1_logits_equal_hf(parity):
    assert parity["world_size"] == 2 and parity["ep"] == 2
    # fp32: the same math in a different order (fused qkv, probs applied before fc2, ...), the same
    # experts chosen (a flipped choice would move a logit by ~1e-2); measured max 1.8e-7 (GLM-4-MoE)
    assert parity["logits_ep2_vs_hf"] <= 1e-5
    assert parity["logits_ep1_vs_hf"] <= 1e-5
    assert parity["logits_ep1_vs_ep2"] <= 1e-5
    # log-softmax over ~100 logits adds rounding of the log-sum-exp: measured 9.5e-7 (GLM-4-MoE)
    assert parity["logprobs_ep2_vs_hf"] <= 1e-5 and parity["logprobs_ep1_vs_hf"] <= 1e-5
    assert parity["values_ep2_vs_hf"] <= 1e-5 and parity["values_ep1_vs_hf"] <= 1e-5


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_gradients_match_hf(parity):
    # grads of the mean over the 2 ranks' SAO losses, experts gathered from both EP ranks;
    # every HF parameter compared (GRAD_TENSORS), zero grads must stay zero
    for ep in (1, 2):
        assert parity[f"grad_tensors_ep{ep}"] == GRAD_TENSORS[parity["arch"]]
        assert parity[f"grad_rel_ep{ep}"] <= 1e-4
        assert parity[f"grad_zero_mismatch_ep{ep}"] == 0


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_one_sao_step_matches_the_torch_step(parity):
    # SGD (lr 0.5, global-norm clip 1.0): the update is linear in the grad -> fp32 rounding.
    assert parity["step_sgd_ep2_max_abs"] <= 1e-6
    assert parity["step_sgd_ep2_max_update"] > 1e-3  # the step did move the weights
    # AdamW (lr 1e-3): lr * g / (|g| + 1e-8) amplifies fp32 noise where |g| ~ 1e-8, so the bound
    # is 0.1 * lr overall, fp32 rounding wherever |g| > 1e-5.
    assert parity["step_adamw_ep2_max_abs"] <= 1e-4
    assert parity["step_adamw_ep2_max_abs_grad_gt_1e-5"] <= 1e-6
    g_m, g_t = parity["step_adamw_ep2_grad_norm"]
    assert abs(g_m - g_t) <= 1e-5 * g_t and g_t > 1.0  # the clip did bind
    assert 0.0 < parity["step_adamw_ep2_clip_frac"] < 1.0  # the SAO band masked some tokens


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_conversion_roundtrip_through_ep_ranks(parity):
    for ep in (1, 2):
        assert parity[f"roundtrip_exact_ep{ep}"] is True
        assert parity[f"value_roundtrip_exact_ep{ep}"] is True


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_critic_step_and_trainer_factory_match_torch(parity):
    # make_megatron_learner(LearnerConfig()): value AdamW lr 1e-3, clip 1.0, clipped value loss
    assert parity["value_step_ep2_max_abs"] <= 1e-3 * 0.1  # 0.1 * lr, as for the policy AdamW step
    assert parity["value_step_ep2_max_abs_grad_gt_1e-5"] <= 1e-6
    g_m, g_t = parity["value_step_ep2_grad_norm"]
    assert abs(g_m - g_t) <= 1e-5 * g_t
    step = parity["factory_policy_step_ep2"]
    lr = LearnerConfig().optim.lr  # the first Adam step moves some weight by ~lr
    assert 0.5 * lr <= step["max_update"] <= 1.5 * lr


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_torch_trainer_step_code_drives_megatron(parity):
    # learner.trainer.step (prepare, value_backward, policy_backward) on the MegatronBackend's models,
    # grads reduced and clipped by its clip_grads, vs trainer.step.update() on the HF models
    r = parity["trainer_step_ep2"]
    assert r["applied"] is True
    for name in ("grad_norm", "value_grad_norm"):
        g_m, g_t = r[name]
        assert g_t > 1.0 and abs(g_m - g_t) <= 1e-5 * g_t  # clip 1.0 binds on both models
    optim = LearnerConfig().optim
    for model, lr in (("policy", optim.lr), ("value", optim.value_lr)):
        assert r[f"{model}_max_abs"] <= 0.1 * lr
        assert r[f"{model}_max_abs_grad_gt_1e-5"] <= 1e-6

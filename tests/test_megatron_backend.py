"""Megatron-core backend: HF <-> megatron conversion, and parity with the HF/torch model under
torchrun (2 processes, gloo, expert parallelism 2 and 1)."""

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


def _merge_ranks(sd, cfg, ep):
    merged = {}
    for r in range(ep):
        merged.update(convert.megatron_to_hf(convert.hf_to_megatron(sd, cfg, r, ep), cfg, r, ep))
    return merged


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_hf_megatron_hf_is_bit_identical(tie, ep):
    policy = build_policy(ModelConfig(tie_embeddings=tie), seed=3)
    sd, cfg = policy.state_dict(), policy.config
    back = _merge_ranks(sd, cfg, ep)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


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
    with pytest.raises(ValueError, match="expert_parallel=3"):
        convert.local_expert_range(8, 0, 3)


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


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron") / "parity.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "learner.backends.megatron.parity", "--out", str(out), "--ep", "2"]
    env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_ep2_and_ep1_logits_equal_hf(parity):
    assert parity["world_size"] == 2 and parity["ep"] == 2
    # fp32: the same math in a different order (fused qkv, probs applied before fc2, ...)
    assert parity["logits_ep2_vs_hf"] <= 1e-5
    assert parity["logits_ep1_vs_hf"] <= 1e-5
    assert parity["logits_ep1_vs_ep2"] <= 1e-5
    assert parity["values_ep2_vs_hf"] <= 1e-5 and parity["values_ep1_vs_hf"] <= 1e-5


def test_gradients_match_hf(parity):
    # grads of the mean over the 2 ranks' SAO losses, experts gathered from both EP ranks;
    # every one of the 133 HF tensors (lm_head tied) compared, zero grads must stay zero
    for ep in (1, 2):
        assert parity[f"grad_tensors_ep{ep}"] == 133
        assert parity[f"grad_rel_ep{ep}"] <= 1e-4
        assert parity[f"grad_zero_mismatch_ep{ep}"] == 0


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


def test_conversion_roundtrip_through_ep_ranks(parity):
    for ep in (1, 2):
        assert parity[f"roundtrip_exact_ep{ep}"] is True
        assert parity[f"value_roundtrip_exact_ep{ep}"] is True


def test_critic_step_and_trainer_factory_match_torch(parity):
    # make_megatron_learner(LearnerConfig()): value AdamW lr 1e-3, clip 1.0, clipped value loss
    assert parity["value_step_ep2_max_abs"] <= 1e-3 * 0.1  # 0.1 * lr, as for the policy AdamW step
    assert parity["value_step_ep2_max_abs_grad_gt_1e-5"] <= 1e-6
    g_m, g_t = parity["value_step_ep2_grad_norm"]
    assert abs(g_m - g_t) <= 1e-5 * g_t
    step = parity["factory_policy_step_ep2"]
    lr = LearnerConfig().optim.lr  # the first Adam step moves some weight by ~lr
    assert 0.5 * lr <= step["max_update"] <= 1.5 * lr


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

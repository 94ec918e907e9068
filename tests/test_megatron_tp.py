"""Megatron backend at tensor parallelism 2: the TP slicing of megatron tensors (pure, by hand), and parity with
the HF/torch model under torchrun (2 processes, gloo, CPU) at (TP 2, expert TP 2) and (TP 2, EP 2, expert TP 1),
for both mapped architectures. megatron-core requires sequence parallelism for MoE training at TP > 1, so these
runs use it (the local spec's norms made SP-aware: `model.SPRMSNorm`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from learner.backends.megatron import convert, parallel, tp  # noqa: E402
from learner.backends.megatron.model import check_tensor_parallel  # noqa: E402
from learner.models.policy import build_policy  # noqa: E402
from tests.test_megatron_backend import GRAD_TENSORS, _free_port, tiny_glm4_moe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _layout(tp_rank: int, tp_size: int, etp_rank: int = 0, etp_size: int = 1) -> dict[str, int]:
    return {"tp": tp_size, "tp_rank": tp_rank, "etp": etp_size, "etp_rank": etp_rank}


@pytest.mark.parametrize("etp", [1, 2])
@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_tp_shards_merge_back_bit_identical(arch, etp):
    policy = build_policy(seed=2) if arch == "qwen3_moe" else tiny_glm4_moe(seed=2)
    full = convert.hf_to_megatron(policy.state_dict(), policy.config, 0, 1)
    shards = [tp.shard_state(full, _layout(r, 2, r % etp, etp)) for r in range(2)]
    for name, t in full.items():
        split = tp.rule(name) is not None and (etp == 2 or not name.count(".mlp.experts."))
        parts = [s[name] for s in shards][:2 if split else 1]
        assert torch.equal(tp.merge(name, parts), t), name
        if split:
            assert parts[0].numel() == t.numel() // 2, name


def test_tp_slices_follow_megatron_core():
    policy = build_policy(seed=1)  # hidden 128, 4 query / 2 KV heads of 32, 8 experts of width 256, vocab V
    sd, cfg = policy.state_dict(), policy.config
    full = convert.hf_to_megatron(sd, cfg, 0, 1)
    r1 = tp.shard_state(full, _layout(1, 2, 1, 2))
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    qkv = r1["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (128, 128)  # TP rank 1 holds KV group 1: query heads 2, 3, then k_1, v_1
    assert torch.equal(qkv[:64], q[64:]) and torch.equal(qkv[64:96], k[32:]) and torch.equal(qkv[96:], v[32:])
    o = sd["model.layers.0.self_attn.o_proj.weight"]  # row-parallel: the input columns of heads 2, 3
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_proj.weight"], o[:, 64:])
    fc1 = r1["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"]  # [gate rows 128:; up rows 128:]
    gate, up = (sd[f"model.layers.1.mlp.experts.5.{n}_proj.weight"] for n in ("gate", "up"))
    assert fc1.shape == (256, 128) and torch.equal(fc1[:128], gate[128:]) and torch.equal(fc1[128:], up[128:])
    down = sd["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert torch.equal(r1["decoder.layers.1.mlp.experts.local_experts.5.linear_fc2.weight"], down[:, 128:])
    emb = sd["model.embed_tokens.weight"]
    assert torch.equal(r1["embedding.word_embeddings.weight"], emb[emb.shape[0] // 2:])  # vocab-parallel rows
    router = "decoder.layers.1.mlp.router.weight"
    assert torch.equal(r1[router], full[router])  # replicated
    # expert TP 1: each expert whole on every TP rank
    whole = tp.shard_state(full, _layout(1, 2, 0, 1))
    assert torch.equal(whole["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"],
                       full["decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight"])


def test_layouts_that_do_not_fit_are_refused_by_name():
    with pytest.raises(ValueError, match="tensor_parallel=2 x pipeline_parallel=2"):
        parallel.check_layout(2, 1, 2, 2)
    with pytest.raises(ValueError, match="expert_parallel=2 x expert_tensor_parallel=2"):
        parallel.check_layout(2, 2, 2, 1, 2)
    with pytest.raises(ValueError, match="pipeline_parallel=0"):
        parallel.check_layout(2, 1, 1, 0)
    parallel.check_layout(2, 2, 2, 1, 1)  # (TP 2, EP 2) on two ranks: experts whole
    cfg = tiny_glm4_moe().config  # 4 query / 2 KV heads
    check_tensor_parallel(cfg, 2, 2)
    with pytest.raises(ValueError, match="num_attention_heads = 4"):
        check_tensor_parallel(cfg, 8, 1)
    cfg.moe_intermediate_size = 33
    with pytest.raises(ValueError, match="moe_intermediate_size = 33"):
        check_tensor_parallel(cfg, 1, 2)


LAYOUTS = {"tp2_etp2": ["--ep", "1", "--tp", "2", "--etp", "2"], "tp2_ep2": ["--ep", "2", "--tp", "2", "--etp", "1"]}


@pytest.fixture(scope="module", params=[(a, lay) for a in sorted(GRAD_TENSORS) for lay in LAYOUTS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def parity(request, tmp_path_factory) -> dict:
    arch, lay = request.param
    out = tmp_path_factory.mktemp("megatron_tp") / "parity.json"
    model = []
    if arch == "glm4_moe":
        model_dir = tmp_path_factory.mktemp("glm4_moe")
        tiny_glm4_moe(seed=0).save_pretrained(model_dir)
        model = ["--model-dir", str(model_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "learner.backends.megatron.parity", "--out", str(out), *LAYOUTS[lay], *model]
    env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(out.read_text()), "arch": arch}


@pytest.mark.slow  # one 2-rank torchrun per (arch, layout), ~18 s each on 2 cores
def test_tp2_forward_and_gradients_match_hf(parity):
    assert parity["world_size"] == 2 and parity["tp"] == 2
    ep = parity["ep"]
    # measured <= 5.1e-7 (logits), 4.8e-7 (log-probs), 2.1e-7 (values): fp32 rounding of another sum order
    for key in ("logits", "logprobs", "values"):
        assert parity[f"{key}_ep{ep}_vs_hf"] <= 1e-5, key
    assert parity[f"grad_tensors_ep{ep}"] == GRAD_TENSORS[parity["arch"]]
    assert parity[f"grad_rel_ep{ep}"] <= 1e-4  # measured <= 1.7e-6
    assert parity[f"grad_zero_mismatch_ep{ep}"] == 0
    assert parity[f"roundtrip_exact_ep{ep}"] is True and parity[f"value_roundtrip_exact_ep{ep}"] is True
    if ep == 2:  # the same TP layout at EP 1 (experts whole, replicated)
        assert parity["logits_ep1_vs_hf"] <= 1e-5 and parity["grad_rel_ep1"] <= 1e-4
        assert parity["logits_ep1_vs_ep2"] <= 1e-5


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_tp2_optimizer_steps_match_torch(parity):
    ep = parity["ep"]
    assert parity[f"step_sgd_ep{ep}_max_abs"] <= 1e-6 and parity[f"step_sgd_ep{ep}_max_update"] > 1e-3
    # AdamW lr 1e-3: fp32 rounding wherever |g| > 1e-5 (measured 7.5e-9); where |g| ~ eps = 1e-8 Adam's
    # g / (|g| + eps) turns rounding into up to ~lr: measured 1.4e-4 at TP 2 (1e-4 was the EP-only bound)
    assert parity[f"step_adamw_ep{ep}_max_abs_grad_gt_1e-5"] <= 1e-6
    assert parity[f"step_adamw_ep{ep}_max_abs"] <= 2e-4
    g_m, g_t = parity[f"step_adamw_ep{ep}_grad_norm"]
    assert abs(g_m - g_t) <= 1e-5 * g_t and g_t > 1.0  # the clip did bind; each weight counted once
    assert parity[f"value_step_ep{ep}_max_abs_grad_gt_1e-5"] <= 1e-6
    r = parity[f"trainer_step_ep{ep}"]  # the trainer's own step code on the megatron models
    assert r["applied"] is True
    for name in ("grad_norm", "value_grad_norm"):
        g_m, g_t = r[name]
        assert abs(g_m - g_t) <= 1e-5 * g_t
    assert r["policy_max_abs_grad_gt_1e-5"] <= 1e-6 and r["value_max_abs_grad_gt_1e-5"] <= 1e-6


def test_backend_config_keys_are_validated_by_name():
    from learner.config import LearnerConfig
    from streamer.wire.config import ConfigError, load_config

    tiny = ["model.num_experts=4", "model.experts_per_token=2", "loss.kl_coef=0"]
    cfg = load_config(LearnerConfig, None, tiny + ["backend.name=megatron", "backend.tensor_parallel=2"])
    assert (cfg.backend.tensor_parallel, cfg.backend.pipeline_parallel) == (2, 1)
    with pytest.raises(ConfigError, match="backend.tensor_parallel: 2 needs the megatron backend"):
        load_config(LearnerConfig, None, ["backend.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="backend.shard_optimizer: True needs the megatron backend"):
        load_config(LearnerConfig, None, ["backend.shard_optimizer=true"])
    with pytest.raises(ConfigError, match="backend.tensor_parallel: 0 must be >= 1"):
        load_config(LearnerConfig, None, tiny + ["backend.name=megatron", "backend.tensor_parallel=0"])
    with pytest.raises(ConfigError, match="backend.tensor_parallel: 4 does not divide model.num_kv_heads 2"):
        load_config(LearnerConfig, None, tiny + ["backend.name=megatron", "backend.tensor_parallel=4"])
    with pytest.raises(ConfigError, match="backend.pipeline_parallel: 2 stages for model.num_layers 1"):
        load_config(LearnerConfig, None, tiny + ["backend.name=megatron", "backend.pipeline_parallel=2",
                                                 "model.num_layers=1"])
    cfg = load_config(LearnerConfig, None, tiny + ["backend.name=megatron", "backend.pipeline_parallel=2",
                                                   "model.num_layers=2"])
    assert cfg.backend.pipeline_parallel == 2


# ---------------------------------------------------------------------- sao learn at TP 2

from tests.test_megatron_learn import TRAIN, _max_abs, _policy, megatron_learn, torch_reference, traj_file  # noqa: E402, F401

TP_TRAIN = TRAIN + ["model.num_kv_heads=2"]  # megatron-core splits whole KV groups over the TP ranks


@pytest.fixture(scope="module")
def tp_run(traj_file, tmp_path_factory) -> Path:  # noqa: F811
    """`sao learn --backend megatron --nproc 2` at TP 2 (the two ranks are one replica: they share every row),
    expert TP 1: 2 steps."""
    root = tmp_path_factory.mktemp("megatron_tp_learn")
    proc = megatron_learn(root, traj_file, ["backend.tensor_parallel=2", *TP_TRAIN], 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def torch_tp_ref(traj_file, tmp_path_factory) -> dict:  # noqa: F811
    """The torch backend on the same file and model, 2 steps (as tests/test_megatron_learn.py's torch_run)."""
    return torch_reference(traj_file, tmp_path_factory.mktemp("torch_tp_ref"), TP_TRAIN, 2)


@pytest.mark.slow  # a 2-rank torchrun of sao learn (~25 s) and a 2-step torch run
def test_sao_learn_at_tp2_matches_the_torch_backend(tp_run, torch_tp_ref):
    from streamer.transport.weights import WeightStore

    events = [json.loads(line) for line in (tp_run / "ck" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["n_trajectories"]) for e in events] == [(1, 7), (2, 7)]
    for e, t in zip(events, torch_tp_ref["events"]):  # metrics over the one replica's rows: not counted twice
        for k in ("grad_norm", "value_grad_norm", "policy_loss", "n_tokens", "clip_frac"):
            m_k, t_k = e["metrics"][f"learner/{k}"], t.metrics[f"learner/{k}"]
            assert abs(m_k - t_k) <= 1e-5 * max(1.0, abs(t_k)), k
    store, ref = WeightStore(tp_run / "w"), torch_tp_ref["store"]
    assert [pv.version for pv in store.versions()] == [0, 1, 2]
    assert _max_abs(_policy(store, 0), _policy(ref, 0)) == 0.0  # HF -> TP slices -> HF lossless
    for v in (1, 2):  # published by shard (one writer: EP 1) after the TP gather; AdamW steps as the torch run's
        assert _max_abs(_policy(store, v), _policy(ref, v)) <= 1e-6
    state = json.loads((tp_run / "ck" / "step_00000002" / "state.json").read_text())
    assert state["layout"] == {"backend": "megatron", "world_size": 2, "expert_parallel": 1, "tensor_parallel": 2}

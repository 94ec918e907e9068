"""Megatron backend at pipeline parallelism 2: the layer split, the stage's HF <-> megatron mapping (by hand), and
parity with the HF/torch model under torchrun (2 processes, gloo, CPU) through megatron-core's 1F1B schedule, for
both mapped architectures (the tiny Qwen3-MoE: 4 layers, tied embeddings; the tiny GLM-4-MoE: 3 layers, split 2 + 1,
untied), the policy and the critic, with 1 and 3 micro-batches; and on 4 processes (PP 2, EP 2: two data-parallel
replicas) and (TP 2, PP 2, EP 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from learner.backends.megatron import convert, parallel, pipeline  # noqa: E402
from learner.models.policy import build_policy  # noqa: E402
from tests.test_megatron_backend import GRAD_TENSORS, _free_port, tiny_glm4_moe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_layer_split_by_hand():
    assert parallel.stage_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert parallel.stage_ranges(3, 2) == [range(0, 2), range(2, 3)]  # the first stage takes the remainder
    assert parallel.stage_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert parallel.config_settings(3, 2) == {"num_layers_in_first_pipeline_stage": 2}
    assert parallel.config_settings(4, 2) == {} and parallel.config_settings(3, 1) == {}
    with pytest.raises(ValueError, match="pipeline_parallel=4 exceeds the model's 3 layers"):
        parallel.stage_ranges(3, 4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_stages_map_their_own_layers_and_merge_back_bit_identical(arch):
    policy = build_policy(seed=2) if arch == "qwen3_moe" else tiny_glm4_moe(seed=2)
    sd, cfg = policy.state_dict(), policy.config
    ranges = parallel.stage_ranges(cfg.num_hidden_layers, 2)
    stages = [pipeline.Stage(tuple(r), first=s == 0, last=s == 1) for s, r in enumerate(ranges)]
    parts = [convert.hf_to_megatron(sd, cfg, stage=st) for st in stages]
    last = parts[1]
    # the last stage names its layers from 0: global layer ranges[1][0] is its decoder.layers.0
    g = ranges[1][0]
    assert torch.equal(last["decoder.layers.0.input_layernorm.weight"], sd[f"model.layers.{g}.input_layernorm.weight"])
    assert "embedding.word_embeddings.weight" not in last and "decoder.final_layernorm.weight" not in parts[0]
    # tied (Qwen3 toy): the last stage's output layer is loaded from the embedding and never exported
    assert ("output_layer.weight" in last) and torch.equal(last["output_layer.weight"], sd["lm_head.weight"])
    merged = {}
    for st, m in zip(stages, parts):
        back = convert.megatron_to_hf(m, cfg, stage=st)
        assert not set(back) & set(merged) - {"lm_head.weight"}, "a tensor exported by two stages"
        merged.update(back)
    assert set(merged) == set(sd) and all(torch.equal(merged[k], sd[k]) for k in sd)
    owners = pipeline._owners(sd, cfg, 2)
    assert owners["model.embed_tokens.weight"] == 0 and owners["model.norm.weight"] == 1
    assert owners[f"model.layers.{g}.input_layernorm.weight"] == 1
    assert owners["lm_head.weight"] == (0 if cfg.tie_word_embeddings else 1)


def test_micro_batches_weight_by_loss_tokens_and_pad_for_tp():
    ids = torch.arange(15).reshape(3, 5)
    lm = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1]])
    mbs = pipeline.micro_batches({"input_ids": ids, "loss_mask": lm, "temperature": None}, 3, tp=2)
    assert [mb["weight"] for mb in mbs] == [4 / 10, 1 / 10, 5 / 10]  # token-mean over the batch = sum of these
    assert mbs[1]["padded_ids"].shape == (1, 6) and mbs[1]["t"] == 5  # T padded to a multiple of TP
    assert mbs[1]["mask4d"][0, 0, 0, 5].item() is True  # the padding column is masked
    assert torch.equal(mbs[2]["input_ids"], ids[2:3]) and mbs[0]["temperature"] is None


# (arch, processes, layout flags)
LAYOUTS = [("qwen3_moe", 2, ["--pp", "2"]), ("glm4_moe", 2, ["--pp", "2"]),
           ("qwen3_moe", 4, ["--pp", "2", "--ep", "2"]), ("glm4_moe", 4, ["--pp", "2", "--tp", "2", "--ep", "2"])]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-{''.join(p[2]).replace('--', '')}")
def parity(request, tmp_path_factory) -> dict:
    arch, nproc, flags = request.param
    out = tmp_path_factory.mktemp("megatron_pp") / "parity.json"
    model = []
    if arch == "glm4_moe":
        model_dir = tmp_path_factory.mktemp("glm4_moe")
        tiny_glm4_moe(seed=0).save_pretrained(model_dir)
        model = ["--model-dir", str(model_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "learner.backends.megatron.parity_pp", "--out", str(out), *flags, *model]
    env = {**os.environ, "SAO_TEST_THREADS": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(out.read_text()), "arch": arch, "nproc": nproc}


@pytest.mark.slow  # one torchrun per layout, 17-25 s each on 2 cores
def test_pp2_forward_and_gradients_match_hf(parity):
    assert parity["world_size"] == parity["nproc"] and parity["pp"] == 2
    # measured 4.5e-7 (logits, last stage), 9.5e-7 (log-probs, broadcast to every stage)
    assert parity["logits_vs_hf"] <= 1e-5 and parity["logits_on_last_stage_only"] is True
    assert parity["logprobs_vs_hf"] <= 1e-5
    assert parity["roundtrip_exact"] is True  # both stages' parts, gathered, equal the HF weights bit for bit
    for m in (1, 3):  # 3 micro-batches: the schedule's warm-up, steady 1F1B and cool-down all run
        assert parity[f"grad_tensors_m{m}"] == GRAD_TENSORS[parity["arch"]]
        assert parity[f"grad_rel_m{m}"] <= 1e-4  # measured <= 1.6e-6 (tied embedding: both stages' parts summed)
        assert parity[f"grad_zero_mismatch_m{m}"] == 0


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_pp2_optimizer_steps_match_torch(parity):
    for m in (1, 3):
        assert parity[f"step_sgd_m{m}_max_abs"] <= 1e-6 and parity[f"step_sgd_m{m}_max_update"] > 1e-3
        assert parity[f"step_adamw_m{m}_max_abs_grad_gt_1e-5"] <= 1e-6
        assert parity[f"step_adamw_m{m}_max_abs"] <= 2e-4  # |g| ~ eps region, as at TP 2 (measured 1.8e-4)
        g_m, g_t = parity[f"step_adamw_m{m}_grad_norm"]
        assert abs(g_m - g_t) <= 1e-5 * g_t and g_t > 1.0  # every weight counted once over the stages
        assert parity[f"step_sgd_m{m}_loss"] > 0.0  # the last stage's SAO loss reached the stats


@pytest.mark.slow  # the `parity` fixture (torchrun)
def test_pp2_critic_matches_the_value_model(parity):
    # the critic's backbone in stages, its head on the last: values within fp32 rounding of H2's ValueModel
    assert parity["values_vs_hf"] <= 1e-5 and parity["value_roundtrip_exact"] is True
    for m in (1, 3):  # one clipped-value-loss AdamW step (lr 1e-3, clip 1.0)
        assert parity[f"value_step_m{m}_max_abs_grad_gt_1e-5"] <= 1e-6
        assert parity[f"value_step_m{m}_max_abs"] <= 1e-4  # 0.1 * lr where |g| ~ eps (measured 5.2e-5)
        g_m, g_t = parity[f"value_step_m{m}_grad_norm"]
        assert abs(g_m - g_t) <= 1e-5 * g_t

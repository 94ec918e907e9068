"""bench/real_model.py's bookkeeping by hand: the state estimate that decides what runs, the parameter count read from
the safetensors headers, the shape of its learner batch; the README quotes its committed figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.real_model import CONFIGS, parameters, state_gib, trajectories
from learner.models.policy import build_policy, save_policy
from learner.trainer.synthetic import tiny_model_config

GIB_PARAMS = 2 ** 30  # one GiB of parameters: the estimate is then the bytes a parameter takes


@pytest.mark.parametrize("config, kl, want", [
    ("baseline", True, 4 + 12 + 16 + 4),  # policy + its grad and AdamW, the value copy likewise, the KL reference
    ("baseline", False, 4 + 12 + 16),
    ("lora", True, 4 + 16),  # frozen policy (the adapters are ~0); LoRA's reference is the base: no copy
    ("value_head", True, 4 + 12 + 4),
    ("lora+head", True, 4),
    ("bf16", True, 36),  # fp32 master weights: bf16 autocast saves no state
    ("value_copy_8", True, 4 + 12 + 16 * 8 / 32 + 4),  # a critic of 8 of the 32 blocks: a quarter of the copy
    ("lora+copy_8", False, 4 + 4),
])
def test_state_estimate_by_hand(config, kl, want):
    assert state_gib(GIB_PARAMS, CONFIGS[config], kl, layers=32) == pytest.approx(want)


def test_parameters_are_counted_from_the_safetensors_headers(tmp_path):
    policy = build_policy(tiny_model_config(), seed=0)
    save_policy(policy, tmp_path / "m")
    assert parameters(tmp_path / "m") == sum(p.numel() for p in policy.parameters())  # tied weights once


def test_the_learner_batch_is_half_prompt_half_answer():
    trajs = trajectories(4, 128, vocab=1000)
    assert [len(t.tokens) for t in trajs] == [len(t.loss_mask) for t in trajs]
    assert all(125 <= len(t.tokens) <= 128 and t.prompt_len == len(t.tokens) // 2 for t in trajs)
    assert all(sum(t.loss_mask) == len(t.tokens) - t.prompt_len for t in trajs)


def test_the_readme_quotes_the_committed_figures():
    """README's memory line: SmolLM2-135M's baseline update against all options on (docs/results/real_model.json)."""
    root = Path(__file__).resolve().parents[1]
    configs = json.loads((root / "docs/results/real_model.json").read_text())["models"]["smollm2-135m"]["configs"]
    text = " ".join((root / "README.md").read_text().split())
    m = re.search(r"took SmolLM2-135M's update from ([\d.]+) GiB, ([\d.]+) tokens/s to ([\d.]+) GiB, ([\d.]+) tokens/s",
                  text)
    assert m, "README no longer quotes bench/real_model.py's figures"
    base, best = configs["baseline"], configs["lora+head+ckpt+micro+bf16"]
    assert m.groups() == (f"{base['peak_rss_gib']:.1f}", f"{base['learner_tokens_per_s']:.0f}",
                          f"{best['peak_rss_gib']:.1f}", f"{best['learner_tokens_per_s']:.0f}")

"""Optimizer profiles (learner.profiles): toy without --model (the embedded defaults, `make up` unchanged),
pretrained for a --model of 10M parameters or more, the user's keys kept, a toy-sized learning rate on a large
model warned about, and the line `sao up` prints. Model sizes come from real safetensors files written here."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from learner.config import LearnerConfig
from learner.models.toy import build_toy_model
from learner.profiles import PRETRAINED, TOY, count_parameters, explain, warnings_for
from streamer.launch import up
from streamer.launch.run_config import load_run_config
from streamer.wire.config import load_config


def sized_model(path: Path, params: int) -> Path:
    """A model directory whose safetensors hold `params` parameters (int8: 1 byte each) and a config.json."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": torch.zeros(params // 1000, 1000, dtype=torch.int8),
               "model.norm.weight": torch.zeros(params % 1000, dtype=torch.int8)}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> Path:
    return sized_model(tmp_path_factory.mktemp("large"), 60_000_123)


def optim_of(lc: LearnerConfig) -> tuple:
    return lc.optim.lr, lc.optim.value_lr, lc.optim.weight_decay, lc.optim.grad_clip, lc.loss.kl_coef, \
        lc.value.warmup_steps


def test_the_toy_profile_is_the_learner_defaults_and_the_embedded_run_keeps_them():
    d = LearnerConfig()
    assert optim_of(d) == (2e-4, 1e-3, 0.0, 1.0, 0.1, 5)
    assert TOY.settings() == {"optim.lr": 2e-4, "optim.value_lr": 1e-3, "optim.weight_decay": 0.0,
                              "optim.grad_clip": 1.0, "loss.kl_coef": 0.1, "value.warmup_steps": 5}
    cfg = load_run_config()
    assert asdict(cfg.learner.optim) == asdict(d.optim) and cfg.learner.loss.kl_coef == 0.1
    assert explain(cfg.learner, "")[0].startswith("profile toy: no --model: the embedded tiny policy; lr 0.0002,")
    # `make up`'s learner otherwise as before issue 47: every memory option off, the learner's own versions kept
    lc = cfg.learner
    assert (lc.policy.lora.r, lc.value.kind, lc.precision, lc.gradient_checkpointing, lc.batch.micro_tokens) == (
        0, "copy", "float32", False, 0)
    assert lc.io.keep_versions == d.io.keep_versions


def test_parameters_counted_from_safetensors_headers_equal_the_loaded_model(tmp_path):
    from transformers import AutoModelForCausalLM

    d = build_toy_model("qwen3", ["a b c", "d e f"] * 20, tmp_path / "toy", vocab_size=300)
    loaded = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(d)).parameters())
    assert count_parameters(d) == loaded
    assert count_parameters(sized_model(tmp_path / "s", 1_234_567)) == 1_234_567
    assert count_parameters(tmp_path) is None  # no safetensors


def test_a_large_model_gets_the_pretrained_profile(large):
    cfg = load_run_config(launch={"model": str(large)})
    assert optim_of(cfg.learner) == (1e-6, 1e-5, 0.01, 1.0, 0.001, 5)
    assert cfg.learner.profile == "auto"  # the request stays; explain says what it chose
    lines = explain(cfg.learner, str(large))
    assert lines == [f"profile pretrained: --model {large} given (60.0M parameters); lr 1e-06, value_lr 1e-05, "
                     f"weight_decay 0.01, grad_clip 1, kl_coef 0.001, critic warm-up 5 steps, 4 versions kept"]
    assert cfg.learner.io.versions_kept() == 4  # a merged version is the model's full size


def test_a_toy_sized_model_keeps_the_toy_profile(tmp_path):
    small = sized_model(tmp_path / "small", 120_000)
    cfg = load_run_config(launch={"model": str(small)})
    assert optim_of(cfg.learner) == (2e-4, 1e-3, 0.0, 1.0, 0.1, 5)
    assert explain(cfg.learner, str(small))[0].startswith(
        f"profile toy: --model {small} given, but 0.1M parameters (< 10M: a toy model)")


def test_your_keys_win_over_the_profile_and_an_unusual_lr_is_warned_about(large, tmp_path):
    (tmp_path / "run.yaml").write_text("learner:\n  loss:\n    kl_coef: 0.05\n")
    cfg = load_run_config(tmp_path / "run.yaml", ["learner.optim.lr=3e-4"], {"model": str(large)})
    assert optim_of(cfg.learner) == (3e-4, 1e-5, 0.01, 1.0, 0.05, 5)  # lr and kl_coef yours, the rest the profile's
    lines = explain(cfg.learner, str(large))
    assert "      optim.lr=0.0003: yours, kept (the profile's: 1e-06)" in lines
    assert "      loss.kl_coef=0.05: yours, kept (the profile's: 0.001)" in lines
    warnings = [line for line in lines if "warning" in line]
    assert len(warnings) == 1 and "optim.lr=0.0003 is unusual for a model of 60.0M parameters (> 0.0001" in warnings[0]


def test_lora_adapters_are_warned_about_above_their_own_usual_rate(large):
    def warned(lr: float) -> list[str]:
        sets = [f"learner.optim.lr={lr}", "learner.policy.lora.r=16"]
        return warnings_for(load_run_config(None, sets, {"model": str(large)}).learner, 60_000_000)
    assert warned(2e-4) == []  # LoRA's usual rate, which is above a full-weight model's limit (1e-4)
    assert len(warned(1e-3)) == 1 and "optim.lr=0.001 is unusual" in warned(1e-3)[0] and "(> 0.0005;" in warned(1e-3)[0]
    assert "LoRA adapters at 1e-4 to 2e-4" in warned(1e-3)[0]


def test_the_profile_can_be_named(large):
    assert optim_of(load_run_config(None, ["learner.profile=pretrained"]).learner) == (1e-6, 1e-5, 0.01, 1.0, 0.001, 5)
    cfg = load_run_config(None, ["learner.profile=toy"], {"model": str(large)})
    assert optim_of(cfg.learner) == (2e-4, 1e-3, 0.0, 1.0, 0.1, 5)
    lines = explain(cfg.learner, str(large))
    assert lines[0].startswith("profile toy: learner.profile=toy given;")
    assert any("warning: optim.lr=0.0002 is unusual" in line for line in lines)
    assert any("warning: optim.value_lr=0.001" in line for line in lines) is False  # 1e-3 is the limit, not above


def test_sao_up_prints_the_profile_and_writes_it_into_the_run_config(large, tmp_path, capsys):
    assert up.main(["--prepare", "--model", str(large), "--runs-dir", str(tmp_path), "--run", "p"]) == 0
    out = capsys.readouterr().out
    assert f"profile pretrained: --model {large} given (60.0M parameters); lr 1e-06" in out
    written = load_config(LearnerConfig, tmp_path / "p" / "config.yaml", section="learner")
    assert optim_of(written) == (PRETRAINED.optim_lr, PRETRAINED.optim_value_lr, 0.01, 1.0, 0.001, 5)


def test_sao_up_prints_the_warning_and_applies_your_unusual_lr(large, tmp_path, capsys):
    assert up.main(["--prepare", "--model", str(large), "--agents", "1", "--runs-dir", str(tmp_path), "--run", "w",
                    "--set", "learner.optim.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    assert f"profile pretrained: --model {large} given (60.0M parameters)" in out
    assert "      optim.lr=0.0003: yours, kept (the profile's: 1e-06)" in out
    assert "      warning: optim.lr=0.0003 is unusual for a model of 60.0M parameters (> 0.0001;" in out
    written = load_config(LearnerConfig, tmp_path / "w" / "config.yaml", section="learner")
    assert written.optim.lr == 3e-4 and written.optim.value_lr == PRETRAINED.optim_value_lr  # warned, not changed

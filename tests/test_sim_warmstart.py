"""Warm-start data and `sao pretrain` plumbing (tiny model, a few steps: no accuracy claims here)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from learner.models import CharTokenizer, ModelConfig, build_policy
from learner.pretrain import PretrainConfig, config_hash, cosine_lr, encode_demo, pretrain, rollout
from learner.engines import make_engine
from simulator.env import make_env
from simulator.scenario import load_scenario
from simulator.warmstart import demos, segments

TINY = {"model": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "num_experts": 2,
                  "experts_per_token": 1, "expert_width": 32}}


def test_mixture_and_tag_dropout_follow_the_scenario():
    scn = load_scenario("default")  # string mixture reverse .7 / sort .2 / rotl .1, tag dropout .5
    sample = [d for d in itertools.islice(demos(scn, seed=0), 8000) if d.task.family == "string"]
    share = {c: sum(d.task.concept == c for d in sample) / len(sample) for c in ("reverse", "sort", "rotl")}
    # ~2000 string demos: the sd of a share near .7 is sqrt(.21/2000) ~ .01; 4 sd tolerance
    assert share == pytest.approx({"reverse": 0.7, "sort": 0.2, "rotl": 0.1}, abs=0.04)
    tagged = sum(d.task.prompt.startswith(d.task.concept + ":") for d in sample) / len(sample)
    assert tagged == pytest.approx(0.5, abs=0.05)
    again = [d for d in itertools.islice(demos(scn, seed=0), 8000) if d.task.family == "string"]
    assert [(d.task.prompt, d.text) for d in again] == [(d.task.prompt, d.text) for d in sample]  # seeded


def test_demonstrations_score_full_reward_in_their_env():
    scn = load_scenario("default")
    for d in itertools.islice(demos(scn, seed=1), 300):
        env = make_env(d.task)
        rest = d.text
        while "</call>" in rest:
            call, rest = rest.split("</call>", 1)
            obs = env.step(call + "</call>").observation
            assert rest.startswith(obs)
            rest = rest[len(obs):]
        step = env.step(rest)
        penalty = d.task.spec.get("error_penalty", 0.0)
        assert step.success and step.reward == (1.0 - penalty if "error" in d.text else 1.0), d.text


def test_observations_are_masked_out_of_the_loss():
    tok = CharTokenizer()
    text = "<call>look(kiv)</call><obs>42</obs>42"
    assert segments(text) == [("<call>look(kiv)</call>", True), ("<obs>42</obs>", False), ("42", True)]
    ids, mask = encode_demo(tok, "age of kiv?", text)
    # <bos> + 11 prompt chars, then <call> l o o k ( k i v ) </call> = 11, <obs> 4 2 </obs> = 4, "42" = 2, <eos>
    assert len(ids) == 1 + 11 + 11 + 4 + 2 + 1
    assert mask == [0] * 12 + [1] * 11 + [0] * 4 + [1] * 3
    assert ids[-1] == tok.eos_id and tok.decode(ids) == "age of kiv?" + text


def test_cosine_schedule_by_hand():
    cfg = PretrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert cosine_lr(0, cfg) == pytest.approx(1e-4)  # warm-up: lr * 1/10
    assert cosine_lr(10, cfg) == pytest.approx(1e-3)  # cosine start
    # halfway through the decay: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert cosine_lr(60, cfg) == pytest.approx(0.55e-3)
    assert cosine_lr(110, cfg) == pytest.approx(1e-4)


def test_rollout_runs_multi_turn_episodes_with_an_untrained_policy():
    torch.manual_seed(0)
    tok = CharTokenizer()
    cfg = ModelConfig(**TINY["model"])
    model = build_policy(cfg, tok.vocab_size, seed=0)
    scn = load_scenario("default")
    tasks = [d.task for d in itertools.islice(demos(scn, seed=3, tagged=False), 24)]
    steps = rollout(make_engine("torch", model, tok), tok, tasks, temperature=1.0, seed=0, max_new_tokens=8)
    assert len(steps) == 24 and all(s.done and 0.0 <= s.reward <= 1.0 for s in steps)


def test_pretrain_trains_saves_and_reuses_the_cache(tmp_path):
    overrides = [f"cache_dir={tmp_path}", "steps=3", "batch_size=16", "micro_batches=2", "eval_every=0",
                 "threads=1"]
    from streamer.config import load_config

    cfg = load_config(PretrainConfig, None, overrides, base=TINY)
    logs: list[str] = []
    path = pretrain(cfg, log=logs.append)
    assert path.name == f"warmstart-{config_hash(cfg, load_scenario_text())}"
    assert (path / "model.safetensors").is_file() and (path / "sao_tokenizer.json").is_file()
    meta = json.loads((path / "pretrain.json").read_text())
    assert meta["config"]["steps"] == 3 and math.isfinite(meta["seconds"])
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert pretrain(cfg, log=logs.append) == path and logs[-1].startswith("pretrain: reusing")
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def load_scenario_text() -> str:
    from simulator.scenario import resolve_path

    return resolve_path("default").read_text()

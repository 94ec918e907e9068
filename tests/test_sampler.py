"""Engines: log-probs equal a fresh full forward, stops, seeding, weight swaps, factory errors."""

from __future__ import annotations

import math

import pytest
import torch

from learner.engines import Generation, make_engine
from learner.engines.sampling import top_p_filter
from learner.engines.torch_sampler import CachedSampler, TorchSampler
from learner.models import CharTokenizer, build_policy, policy_logits, save_policy, token_logprobs
from learner.models.tokenizer import EOS_ID

TOK = CharTokenizer()
V = TOK.vocab_size


@pytest.fixture(scope="module")
def policy():
    return build_policy(seed=0)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[TOK.bos_id] + torch.randint(8, V, (n - 1,), generator=g).tolist() for n in lengths]


def _reference_logprobs(model, prompt: list[int], gen: Generation) -> torch.Tensor:
    full = torch.tensor([prompt + gen.token_ids])
    return token_logprobs(model, full)[0, len(prompt):]


# Prompt lengths differ (left padding) and one is 30 long: 4 x 30 prefill tokens take the grouped MoE path,
# decode steps (4 tokens) the dense one, so both compact-MoE paths are checked against the HF forward.
LENGTHS = [30, 3, 17, 1]
SETTINGS = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)]


@pytest.mark.parametrize("engine_name", ["torch", "hf"])
@pytest.mark.parametrize("temperature,top_p", SETTINGS)
def test_logprobs_equal_a_fresh_forward(policy, engine_name, temperature, top_p):
    engine = make_engine(engine_name, policy, TOK)
    prompts = _prompts(LENGTHS)
    gens = engine.generate(prompts, max_new_tokens=12, temperature=temperature, top_p=top_p, seed=5)
    assert len(gens) == len(prompts)
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) == len(g.sample_logprobs) >= 1
        ref = _reference_logprobs(policy, p, g)
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-5, rtol=0)
        if temperature == 0:
            assert g.sample_logprobs == [0.0] * len(g.token_ids)
        elif temperature == 1.0 and top_p == 1.0:
            torch.testing.assert_close(torch.tensor(g.sample_logprobs), ref, atol=1e-5, rtol=0)
        else:  # the sampling distribution recomputed from a fresh forward: softmax(top_p(logits / T))
            full = torch.tensor([p + g.token_ids])
            logits = policy_logits(policy, full)[0, len(p) - 1:-1]
            sample_logp = torch.log_softmax(top_p_filter(logits / temperature, top_p), -1)
            expected = sample_logp.gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(g.sample_logprobs), expected, atol=1e-5, rtol=0)


def test_greedy_matches_between_engines(policy):
    prompts = _prompts(LENGTHS, seed=1)
    ours = make_engine("torch", policy, TOK).generate(prompts, 10, temperature=0)
    theirs = make_engine("hf", policy, TOK).generate(prompts, 10, temperature=0)
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]


class PrefillRows(TorchSampler):
    """The real engine, recording how many rows each prefill ran."""

    def _prefill(self, ids, valid, max_new_tokens):
        self.prefill_rows.append(ids.shape[0])
        return super()._prefill(ids, valid, max_new_tokens)


@pytest.mark.parametrize("sampler", [TorchSampler, CachedSampler])  # both BatchedSampler model paths
def test_identical_prompts_share_one_prefill_and_sample_apart(policy, sampler):
    engine = sampler(policy, TOK)
    p, q = _prompts([9, 4], seed=3)
    greedy = engine.generate([p, q, p, p], 8, temperature=0)
    assert greedy[0].token_ids == greedy[2].token_ids == greedy[3].token_ids
    assert greedy[0].token_ids == engine.generate([p], 8, temperature=0)[0].token_ids
    assert greedy[1].token_ids == engine.generate([q], 8, temperature=0)[0].token_ids
    group = engine.generate([p] * 8, 12, temperature=1.0, seed=4)  # a GRPO group: one draw per row
    assert len({tuple(g.token_ids) for g in group}) > 1
    for g in group:
        torch.testing.assert_close(torch.tensor(g.logprobs), _reference_logprobs(policy, p, g), atol=1e-5, rtol=0)
    if sampler is TorchSampler:
        counted = PrefillRows(policy, TOK)
        counted.prefill_rows = []
        counted.generate([p, q, p, p, q], 4, temperature=1.0, seed=1)
        assert counted.prefill_rows == [2]


def test_seeded_sampling_is_reproducible(policy):
    engine = TorchSampler(policy, TOK)
    prompts = _prompts([5, 9], seed=2)
    a = engine.generate(prompts, 16, seed=7)
    b = engine.generate(prompts, 16, seed=7)
    c = engine.generate(prompts, 16, seed=8)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


@pytest.mark.parametrize("engine_name", ["torch", "hf"])
def test_stop_token_stop_string_eos_and_length(policy, engine_name):
    engine = make_engine(engine_name, policy, TOK)
    prompt = _prompts([6], seed=4)
    free = engine.generate(prompt, 12, temperature=0)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    # Greedy is deterministic, so stopping on its 3rd token ends right there, token included.
    third = free.token_ids[2]
    first_hit = free.token_ids.index(third) + 1
    by_id = engine.generate(prompt, 12, temperature=0, stop=[third])[0]
    assert (by_id.token_ids, by_id.finish_reason) == (free.token_ids[:first_hit], "stop")
    # A two-character stop string (two tokens) ends where its first occurrence completes.
    text = TOK.decode(free.token_ids)
    target = text[3:5]
    end_char = text.index(target) + len(target)
    by_str = engine.generate(prompt, 12, temperature=0, stop=[target])[0]
    assert by_str.finish_reason == "stop" and TOK.decode(by_str.token_ids) == text[:end_char]
    # Sampling at T=1 from a random model: eos (p ~ 1/V per step) appears in some of 24 rows x 40 steps.
    gens = engine.generate(_prompts([4] * 24, seed=6), 40, seed=3)
    reasons = {g.finish_reason for g in gens}
    assert "eos" in reasons
    for g in gens:
        assert (g.finish_reason == "eos") == (g.token_ids[-1] == EOS_ID)
        assert EOS_ID not in g.token_ids[:-1]
        assert g.finish_reason != "length" or len(g.token_ids) == 40


def test_markup_stop_string_is_one_token(policy):
    engine = TorchSampler(policy, TOK)
    close_call = TOK.encode("</call>")[0]
    gens = engine.generate(_prompts([3] * 16, seed=9), 30, seed=1, stop=["</call>"])
    for g in gens:
        assert (g.finish_reason == "stop") == (g.token_ids[-1] == close_call)


def test_weight_swap_bumps_version_and_takes_effect(policy, tmp_path):
    engine = TorchSampler(build_policy(seed=0), TOK)
    new = build_policy(seed=42)
    save_policy(new, tmp_path / "v1")
    prompts = _prompts([4, 7])
    before = engine.generate(prompts, 8, temperature=0)
    engine.load_weights(tmp_path / "v1")
    assert engine.version == 1
    after = engine.generate(prompts, 8, temperature=0)
    assert all(g.version == 1 for g in after)
    for p, g in zip(prompts, after):
        torch.testing.assert_close(torch.tensor(g.logprobs), _reference_logprobs(new, p, g), atol=1e-5, rtol=0)
    assert [g.token_ids for g in before] != [g.token_ids for g in after]
    engine.load_state_dict(policy.state_dict(), version=7)
    assert engine.version == 7


def test_sampler_snapshot_ignores_in_place_training_updates(policy):
    model = build_policy(seed=0)
    engine = TorchSampler(model, TOK)
    prompts = _prompts([5])
    before = engine.generate(prompts, 6, temperature=0)[0]
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
    after = engine.generate(prompts, 6, temperature=0)[0]
    assert before.logprobs == after.logprobs  # only load_state_dict / load_weights changes what it samples


def test_factory_and_bad_input(policy, tmp_path):
    save_policy(policy, tmp_path / "p", TOK)
    engine = make_engine("torch", tmp_path / "p")
    assert engine.tokenizer is not None and engine.version == 0
    with pytest.raises(NotImplementedError, match=r"sao-lab\[vllm\]"):
        make_engine("vllm", policy, TOK)
    with pytest.raises(ValueError, match="unknown engine 'jax'"):
        make_engine("jax", policy, TOK)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 5], []], 4)
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        engine.generate([[1, V + 3]], 4)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], 4, top_p=0.0)


def test_top_p_filter_by_hand():
    # Probabilities 0.5, 0.3, 0.2 with top_p = 0.7: ascending cumulative 0.2, 0.5, 1.0; drop those <= 1 - 0.7 = 0.3,
    # i.e. only 0.2. Renormalised: 0.5 / 0.8 = 0.625 and 0.3 / 0.8 = 0.375.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    probs = top_p_filter(logits, 0.7).softmax(-1)
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0]]))
    # top_p small: only the argmax survives.
    assert top_p_filter(logits, 0.1).softmax(-1)[0].tolist() == [1.0, 0.0, 0.0]
    assert math.isclose(float(top_p_filter(logits, 1.0).logsumexp(-1)), 0.0, abs_tol=1e-6)


def test_rows_leaving_the_batch_do_not_disturb_the_others(policy):
    # Stopping on a quarter of the vocabulary ends most of 16 rows within a few steps, so the sampler drops
    # finished rows from its cache (once they are half the batch); survivors must still match a fresh forward.
    engine = TorchSampler(policy, TOK)
    stop_ids = list(range(8, 8 + (V - 8) // 4))
    prompts = _prompts([5, 12, 3, 8] * 4, seed=11)
    gens = engine.generate(prompts, 20, seed=2, stop=stop_ids)
    lengths = sorted(len(g.token_ids) for g in gens)
    assert lengths[-1] >= lengths[len(lengths) // 2] + 2  # half had ended (compaction) while someone kept going
    for p, g in zip(prompts, gens):
        torch.testing.assert_close(torch.tensor(g.logprobs), _reference_logprobs(policy, p, g), atol=1e-5, rtol=0)
        last = g.token_ids[-1]
        assert g.finish_reason == ("eos" if last == EOS_ID else "stop" if last in stop_ids else "length")
        assert not set(g.token_ids[:-1]) & set(stop_ids + [EOS_ID])

"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from learner.algorithms import (
    adaptive_lambda,
    dr_grpo,
    gae,
    group_advantages,
    grpo,
    masked_whiten,
    place_reward,
    rloo,
    sao_advantages,
)

# One trajectory: a prompt token (mask 0), two generated tokens, an environment observation
# (mask 0, a gap) and a final generated token carrying reward 1. Values and rewards at masked
# positions are garbage that must be ignored.
MASK = torch.tensor([[0, 1, 1, 0, 1]])
VALUES = torch.tensor([[7.0, 0.5, 0.6, 9.0, 0.8]], dtype=torch.float64)
REWARDS = torch.tensor([[3.0, 0.0, 0.0, 5.0, 1.0]], dtype=torch.float64)
# Over generated tokens only: V = [0.5, 0.6, 0.8], r = [0, 0, 1]; with gamma = 1
# deltas d = r + V_next - V = [0 + 0.6 - 0.5, 0 + 0.8 - 0.6, 1 + 0 - 0.8] = [0.1, 0.2, 0.2]


@pytest.mark.parametrize("lam, adv", [
    (0.0, [0.1, 0.2, 0.2]),  # A = d
    # A2 = 0.2; A1 = 0.2 + 0.95·0.2 = 0.39; A0 = 0.1 + 0.95·0.39 = 0.4705
    (0.95, [0.4705, 0.39, 0.2]),
    (1.0, [0.5, 0.4, 0.2]),  # A = R - V = 1 - V (Monte-Carlo)
])
def test_gae_skips_gaps(lam, adv):
    a, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=lam)
    expect = [0.0, adv[0], adv[1], 0.0, adv[2]]
    assert a[0].tolist() == pytest.approx(expect)
    # returns = A + V on generated tokens, 0 elsewhere
    assert ret[0].tolist() == pytest.approx([0.0, adv[0] + 0.5, adv[1] + 0.6, 0.0, adv[2] + 0.8])


def test_gae_discount_counts_generated_tokens_only():
    # gamma = 0.5, lam = 1: A_t = discounted return - V_t over generated tokens:
    # A2 = 1 - 0.8 = 0.2; A1 = 0.5·1 - 0.6 = -0.1; A0 = 0.25·1 - 0.5 = -0.25
    a, _ = gae(REWARDS, VALUES, MASK, gamma=0.5, lam=1.0)
    assert a[0].tolist() == pytest.approx([0.0, -0.25, -0.1, 0.0, 0.2])


def test_gae_per_sequence_lambda_and_batch():
    # row 0 as above with lam 0 and row 1 the same with lam 1: each row gets its own lambda
    a, _ = gae(REWARDS.repeat(2, 1), VALUES.repeat(2, 1), MASK.repeat(2, 1), 1.0, torch.tensor([0.0, 1.0]))
    assert a[0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.0, 0.2])
    assert a[1].tolist() == pytest.approx([0.0, 0.5, 0.4, 0.0, 0.2])


def test_sao_advantages_decoupled_lambda():
    # actor lambda 0 -> A = deltas; critic lambda 1 -> returns = Monte-Carlo return 1 everywhere
    adv, ret = sao_advantages(REWARDS, VALUES, MASK, gamma=1.0, lam_actor=0.0, lam_critic=1.0)
    assert adv[0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.0, 0.2])
    assert ret[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, 1.0])
    # normalised: A over generated = [0.1, 0.2, 0.2], mean 0.5/3, population std sqrt(2/900)
    adv, _ = sao_advantages(REWARDS, VALUES, MASK, lam_actor=0.0, normalize=True)
    std = math.sqrt(((0.1 - 1 / 6) ** 2 + 2 * (0.2 - 1 / 6) ** 2) / 3)
    assert adv[0].tolist() == pytest.approx([0.0, (0.1 - 1 / 6) / std, (0.2 - 1 / 6) / std, 0.0, (0.2 - 1 / 6) / std],
                                            rel=1e-6)


def test_adaptive_lambda():
    # L = 40, alpha 0.05: 1 - 1/(0.05·40) = 0.5; L = 10: 1 - 1/0.5 = -1 -> clamped to 0
    # L = 200: 1 - 1/10 = 0.9
    mask = torch.zeros(3, 200)
    mask[0, :40] = 1
    mask[1, 5:15] = 1
    mask[2] = 1
    assert adaptive_lambda(mask, 0.05).tolist() == pytest.approx([0.5, 0.0, 0.9])
    with pytest.raises(ValueError, match="alpha"):
        adaptive_lambda(mask, 0.0)


def test_place_reward_on_last_generated_token():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    r = place_reward(torch.tensor([2.0, 3.0]), mask)
    assert r.tolist() == [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 3.0]]
    with pytest.raises(ValueError, match="no generated token"):
        place_reward(torch.tensor([1.0]), torch.tensor([[0, 0]]))


REWARDS_G = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.5])
GROUPS = ["a", "a", "a", "b", "b", "b", "b", "c"]


def test_grpo_family():
    # group a constant -> 0 (no NaN); group b: mean 0.5, unbiased std sqrt(4·0.25/3) = sqrt(1/3)
    # grpo b: ±0.5/sqrt(1/3) = ±0.8660; dr_grpo b: ±0.5; rloo b: 4/3·(±0.5) = ±2/3
    # (check: R=1, the others' mean (0+0+1)/3 = 1/3, 1 - 1/3 = 2/3); group c of one -> 0
    s = 0.5 / math.sqrt(1 / 3)
    assert grpo(REWARDS_G, GROUPS).tolist() == pytest.approx([0, 0, 0, -s, s, -s, s, 0], abs=1e-5)
    assert dr_grpo(REWARDS_G, GROUPS).tolist() == pytest.approx([0, 0, 0, -0.5, 0.5, -0.5, 0.5, 0])
    assert rloo(REWARDS_G, GROUPS).tolist() == pytest.approx([0, 0, 0, -2 / 3, 2 / 3, -2 / 3, 2 / 3, 0])
    for fn in (grpo, dr_grpo, rloo):
        assert torch.isfinite(fn(torch.ones(4), [0, 0, 0, 0])).all()
        assert fn(torch.ones(4), [0, 0, 0, 0]).abs().max() == 0.0


def test_group_advantages_broadcast_and_normalise():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    # dr_grpo of [1, 0] in one group: [0.5, -0.5] on each row's generated tokens
    tok = group_advantages("dr_grpo", torch.tensor([1.0, 0.0]), [0, 0], mask)
    assert tok.tolist() == [[0.5, 0.5, 0.0], [0.0, -0.5, -0.5]]
    # whitened over the 4 generated tokens: mean 0, std 0.5 -> ±1
    tok = group_advantages("dr_grpo", torch.tensor([1.0, 0.0]), [0, 0], mask, normalize=True)
    assert tok.flatten().tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="unknown group estimator"):
        group_advantages("gae", torch.ones(2), [0, 0], mask)


def test_masked_whiten_constant_is_zero():
    x = torch.tensor([[2.0, 2.0, 100.0]])
    assert masked_whiten(x, torch.tensor([[1, 1, 0]])).tolist() == [[0.0, 0.0, 0.0]]

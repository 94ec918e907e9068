"""The value model as a head on the policy's backbone (learner.value.kind=head): its values, loss and gradients by
hand, where its gradient goes (the head alone, or also the shared backbone), and a learner update with it."""

from __future__ import annotations

import pytest
import torch

from learner.algorithms import value_loss
from learner.models.policy import build_policy
from learner.models.scoring import values
from learner.models.value import ValueHead, ValueModel
from learner.train import build_models
from learner.trainer.batching import collate
from learner.trainer.step import prepare, update
from learner.trainer.synthetic import synthetic_trajectories, tiny_model_config
from tests.test_trainer import make_cfg

IDS = torch.tensor([[1, 9, 12, 15], [1, 20, 21, 0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # the second row is padded


@pytest.fixture()
def policy():
    return build_policy(tiny_model_config(), seed=0).train()


def test_head_values_are_the_copy_critics_with_the_same_head_and_zero_off_the_mask(policy):
    head, copy = ValueHead(policy), ValueModel.from_policy(policy)
    copy.head.load_state_dict(head.head.state_dict())
    v = values(head, IDS, MASK)
    assert v.shape == IDS.shape and v[1, 3] == 0 and bool((v[MASK.bool()] != 0).all())
    assert torch.allclose(v, values(copy, IDS, MASK), atol=1e-6)
    at = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]]).bool()
    assert torch.allclose(values(head, IDS, MASK, at=at), torch.where(at, v, torch.zeros_like(v)), atol=1e-6)
    assert set(head.state_dict()) == {"head.weight", "head.bias"} and len(list(head.parameters())) == 2


def test_value_loss_and_head_gradient_by_hand(policy):
    head = ValueHead(policy)
    with torch.no_grad():
        head.head.bias.fill_(0.5)  # every value 0.5 ...
        head.head.weight.zero_()  # ... whatever the state
    v = values(head, IDS, MASK)
    returns = torch.tensor([[0.0, 1.0, 0.0, 9.0], [0.0, 0.25, 7.0, 0.0]])
    loss_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]).float()  # the 9.0 and 7.0 are off the mask
    loss, m = value_loss(v, v.detach(), returns, loss_mask, None, "token_mean")
    # 0.5 * mean((0.5-1)^2, (0.5-0)^2, (0.5-0.25)^2) = 0.5 * (0.25 + 0.25 + 0.0625) / 3
    assert float(loss.detach()) == pytest.approx(0.09375, abs=1e-7)
    assert m["value_loss"] == pytest.approx(0.09375, abs=1e-7)
    loss.backward()
    # d/d bias = mean(V - R) = (-0.5 + 0.5 + 0.25) / 3
    assert float(head.head.bias.grad) == pytest.approx(0.25 / 3, abs=1e-7)


@pytest.mark.parametrize("detach", [True, False])
def test_the_value_gradient_reaches_the_backbone_only_when_not_detached(policy, detach):
    head = ValueHead(policy, detach_backbone=detach)
    loss_mask = MASK.float()
    v = values(head, IDS, MASK)
    loss, _ = value_loss(v, v.detach(), torch.ones_like(v), loss_mask, None, "token_mean")
    loss.backward()
    assert head.head.weight.grad.abs().sum() > 0
    backbone = {n: p.grad for n, p in policy.model.named_parameters()}
    if detach:
        assert all(g is None for g in backbone.values())
    else:
        attention = backbone["layers.0.self_attn.q_proj.weight"]
        assert attention is not None and attention.abs().sum() > 0
        assert backbone["embed_tokens.weight"].abs().sum() > 0


def _one_update(tmp_path, batch, head_state, *options):
    cfg = make_cfg(tmp_path, "optim.lr=0.01", "optim.grad_clip=1e9", *options)
    models = build_models(cfg)
    models.value.head.load_state_dict(head_state)
    _, applied = update(cfg, models, batch, prepare(cfg, models, batch), train_policy=True)
    assert applied
    return models


def test_a_detached_head_updates_as_the_copy_critic_and_a_joint_one_moves_the_backbone(tmp_path):
    policy0 = build_policy(tiny_model_config(), seed=0)
    batch = collate(synthetic_trajectories(policy0, 6))
    head_state = {k: v.clone() for k, v in ValueHead(policy0).head.state_dict().items()}
    copy = _one_update(tmp_path, batch, head_state, "value.kind=copy")
    detached = _one_update(tmp_path, batch, head_state, "value.kind=head")
    joint = _one_update(tmp_path, batch, head_state, "value.kind=head", "value.detach_backbone=false")
    # same values -> same advantages -> the same policy step, and the same head step (same states, same loss)
    pc, pd, pj = (m.policy.state_dict() for m in (copy, detached, joint))
    assert all(torch.allclose(pc[k], pd[k], atol=1e-6) for k in pc)
    assert torch.allclose(copy.value.head.weight, detached.value.head.weight, atol=1e-6)
    assert not torch.equal(pc["lm_head.weight"], policy0.state_dict()["lm_head.weight"])
    # joint: the value loss's gradient also moved the shared backbone, through the policy's optimizer
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (pj[q] - pd[q]).abs().max() > 1e-6


def test_a_critic_only_update_with_a_joint_head_leaves_the_policy(tmp_path):
    cfg = make_cfg(tmp_path, "optim.lr=0.01", "value.kind=head", "value.detach_backbone=false")
    models = build_models(cfg)
    batch = collate(synthetic_trajectories(models.policy, 4))
    before = {k: v.clone() for k, v in models.policy.state_dict().items()}
    head = models.value.head.weight.detach().clone()
    _, applied = update(cfg, models, batch, prepare(cfg, models, batch, train_policy=False), train_policy=False)
    assert applied and not torch.equal(models.value.head.weight, head)
    assert all(torch.equal(v, before[k]) for k, v in models.policy.state_dict().items())

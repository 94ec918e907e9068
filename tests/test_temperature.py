"""Scoring at the sampling temperature: the learner's log-probs are those the agent sampled from.

By hand: log_softmax(logits / T) on three-token distributions; per-row temperatures; the batch and
the schema carry the temperature; greedy trajectories are refused at admission. End to end: the torch
engine samples real rollouts at T = 0.7 and 1.3, and the learner's scoring of the same tokens gives a
ratio of 1 on every generated token (and, scored at 1 as before, it does not).
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest
import torch
from kafka_fixtures import scenario_tasks

from learner.config import LearnerConfig
from learner.engines.torch_sampler import TorchSampler
from learner.models import CharTokenizer, build_policy, logprobs_and_entropy
from learner.models.scoring import entropy_from_logits, logprobs_from_logits, scale_logits
from learner.train import build_models
from learner.trainer.batching import collate
from learner.trainer.staleness import Admission
from learner.trainer.step import policy_backward, prepare, shard_batch
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.agent.rollouts import run_tasks
from streamer.wire.config import load_config
from streamer.wire.schema import Trajectory, decode, decode_json, encode, encode_json
from streamer.wire.settings import AgentSettings

TOK = CharTokenizer()
LN2 = math.log(2.0)


def _one_step(logits_row: list[float]):
    """logits [1, 2, 3]: position 0 predicts token 1 (= 2 here); mask all real."""
    logits = torch.tensor([[logits_row, [0.0, 0.0, 0.0]]])
    return logits, torch.tensor([[0, 2]]), torch.ones(1, 2, dtype=torch.long)


# ------------------------------------------------------------------ by hand

def test_logprob_at_temperature_by_hand():
    logits, ids, mask = _one_step([0.0, LN2, 2 * LN2])  # probabilities 1:2:4 at T = 1
    lp = lambda t: float(logprobs_from_logits(logits, ids, mask, t)[0, 1])  # noqa: E731
    assert lp(None) == pytest.approx(math.log(4 / 7), abs=1e-6)
    assert lp(1.0) == pytest.approx(math.log(4 / 7), abs=1e-6)
    assert lp(0.5) == pytest.approx(math.log(16 / 21), abs=1e-6)  # 1:4:16
    assert lp(2.0) == pytest.approx(math.log(2 / (3 + math.sqrt(2))), abs=1e-6)  # 1:sqrt2:2
    p = [1 / 21, 4 / 21, 16 / 21]
    ent = float(entropy_from_logits(logits, mask, 0.5)[0, 1])
    assert ent == pytest.approx(-sum(x * math.log(x) for x in p), abs=1e-6)
    assert float(logprobs_from_logits(logits, ids, mask, 0.5)[0, 0]) == 0.0  # the first token is never scored


def test_per_row_temperatures_equal_log_softmax_of_scaled_logits():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(3, 5, 7, generator=g)
    ids, mask = torch.randint(0, 7, (3, 5), generator=g), torch.ones(3, 5, dtype=torch.long)
    temps = torch.tensor([0.7, 1.0, 1.3])
    got = logprobs_from_logits(logits, ids, mask, temps)
    for i, t in enumerate(temps.tolist()):
        want = torch.log_softmax(logits[i, :-1] / t, -1).gather(-1, ids[i, 1:, None]).squeeze(-1)
        torch.testing.assert_close(got[i, 1:], want, atol=1e-6, rtol=0)
        torch.testing.assert_close(got[i], logprobs_from_logits(logits[i:i + 1], ids[i:i + 1], mask[i:i + 1], t)[0])
    ent = entropy_from_logits(logits, mask, temps)
    lp = torch.log_softmax(logits[:, :-1] / temps[:, None, None], -1)
    torch.testing.assert_close(ent[:, 1:], -(lp.exp() * lp).sum(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", [0.0, -1.0, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]),
                                 torch.ones(2, 1)])
def test_bad_temperatures_raise(bad):
    with pytest.raises(ValueError, match="temperature"):
        scale_logits(torch.zeros(2, 3, 4), bad)


def test_temperature_one_is_the_logits_themselves():
    x = torch.randn(2, 3, 4)
    assert scale_logits(x, None) is x and scale_logits(x, 1.0) is x and scale_logits(x, torch.ones(2)) is x


# ------------------------------------------------------------------ the wire, the batch, admission

def _traj(**kw) -> Trajectory:
    base = dict(traj_id="t1", task_id="k1", family="arith", concept="add", prompt_len=2, tokens=[1, 5, 6, 2],
                loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.1], reward=1.0)
    return Trajectory(**{**base, **kw})


def test_schema_carries_temperature_and_old_messages_decode_at_one():
    t = _traj(temperature=0.7)
    assert decode(encode(t), Trajectory).temperature == 0.7
    assert decode_json(encode_json(t), Trajectory).temperature == 0.7
    old = msgspec.to_builtins(_traj())
    del old["temperature"]  # a message from before the field existed (same schema version)
    assert decode(msgspec.msgpack.encode(old), Trajectory).temperature == 1.0


def test_collate_and_batch_views_carry_temperature():
    policy = build_policy(tiny_model_config(), seed=0)
    trajs = [msgspec.structs.replace(t, temperature=x)
             for t, x in zip(synthetic_trajectories(policy, 3), (0.7, 1.0, 1.3))]
    b = collate(trajs)
    assert b.temperature.tolist() == pytest.approx([0.7, 1.0, 1.3])
    assert b.rows(1, 3).temperature.tolist() == pytest.approx([1.0, 1.3])
    assert b.to("cpu").temperature.tolist() == pytest.approx([0.7, 1.0, 1.3])
    shard = type("S", (), {"index": torch.tensor([2, 0]), "real": torch.tensor([True, True])})()
    local, _ = shard_batch(b, {}, shard)
    assert local.temperature.tolist() == pytest.approx([1.3, 0.7])


def test_greedy_trajectories_are_refused_and_counted():
    adm = Admission(max_staleness=5)
    assert adm.admit(_traj(task_id="a", temperature=0.0), 0) == "greedy"
    assert adm.admit(_traj(task_id="b", temperature=-1.0), 0) == "greedy"
    assert adm.admit(_traj(task_id="c", temperature=math.nan), 0) == "invalid"
    assert adm.admit(_traj(task_id="d", temperature=0.7), 0) == "ok"
    assert adm.counts == Counter(greedy=2, invalid=1, ok=1)


# ------------------------------------------------------------------ end to end, on-policy

def _rollouts(policy, temperature: float) -> list[Trajectory]:
    """Real agent rollouts (streamer.agent.rollouts) of simulator tasks, sampled by the torch engine."""
    s = AgentSettings(temperature=temperature, max_new_tokens=12, concurrency=4, seed=3)
    done = run_tasks(TorchSampler(policy, TOK), TOK, scenario_tasks(8), s)
    return [t for ts in done for t in ts]


def _ratios(policy, batch, temperature) -> torch.Tensor:
    with torch.no_grad():
        logp, _ = logprobs_and_entropy(policy, batch.input_ids, batch.attention_mask, temperature)
    return (logp - batch.old_logp)[batch.loss_mask.bool()].exp()


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_on_policy_ratio_is_one_at_the_sampling_temperature(temperature):
    policy = build_policy(tiny_model_config(), seed=0)
    trajs = _rollouts(policy, temperature)
    assert all(t.temperature == temperature for t in trajs)  # the agent fills it
    batch = collate(trajs)
    r = _ratios(policy, batch, batch.temperature)
    assert r.numel() > 50 and float((r - 1).abs().max()) < 1e-4
    # sanity: scored at temperature 1 (the learner before this fix), the same tokens are off-policy
    assert float((_ratios(policy, batch, None) - 1).abs().max()) > 0.05


def test_trainer_step_scores_at_temperature(tmp_path):
    """prepare (decoupled PPO's proximal log-probs) and policy_backward (SAO's strict clip) use it."""
    cfg = load_config(LearnerConfig, None, TINY_OVERRIDES + [f"checkpoint.dir={tmp_path}", "threads=1",
                                                             "loss.name=decoupled_ppo"])
    models = build_models(cfg)
    batch = collate(_rollouts(models.policy, 0.5))
    ref = prepare(cfg, models, batch)
    on = batch.loss_mask.bool()
    assert float((ref["prox_logp"] - batch.old_logp)[on].abs().max()) < 1e-4
    sao = load_config(LearnerConfig, None, TINY_OVERRIDES + [f"checkpoint.dir={tmp_path}", "threads=1"])
    ref = {k: v for k, v in ref.items() if k != "prox_logp"}
    assert policy_backward(sao, models, batch, ref)["clip_frac"] == 0.0
    batch.temperature = None  # scored at 1: some on-policy tokens fall outside [0.8, 1.2]
    assert policy_backward(sao, models, batch, ref)["clip_frac"] > 0.0


def test_top_p_on_policy_ratio_is_the_nucleus_mass():
    """Behaviour log-probs are of the truncated distribution, the learner scores without top-p:
    on-policy r = pi_T / (pi_T / Z) = Z, the nucleus mass, in [top_p, 1] (module doc of batching)."""
    policy = build_policy(tiny_model_config(), seed=0)
    s = AgentSettings(temperature=0.7, top_p=0.9, max_new_tokens=12, concurrency=4, seed=3)
    batch = collate([t for ts in run_tasks(TorchSampler(policy, TOK), TOK, scenario_tasks(8), s) for t in ts])
    r = _ratios(policy, batch, batch.temperature)
    assert float(r.min()) >= 0.9 - 1e-4 and float(r.max()) <= 1 + 1e-4
    assert float(r.max()) < 0.99  # the tiny model's flat distributions: the nucleus always cuts some mass


def test_megatron_forward_logprobs_takes_the_temperature(monkeypatch):
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from learner.backends.megatron import learner as megatron_learner
    from learner.backends.megatron.learner import MegatronLearner

    # the logits stand in for the model's (whose run needs megatron's parallel state): the temperature is the point
    monkeypatch.setattr(megatron_learner, "megatron_logits", lambda model, ids, mask: model(ids, mask))

    logits, ids, mask = _one_step([0.0, LN2, 2 * LN2])
    fake = SimpleNamespace(device=torch.device("cpu"), policy=lambda *_: logits, layout={"pp": 1, "tp": 1})
    lp = MegatronLearner.forward_logprobs(fake, ids, mask, torch.tensor([0.5]))
    assert float(lp[0, 1]) == pytest.approx(math.log(16 / 21), abs=1e-6)

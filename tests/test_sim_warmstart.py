"""Warm-start data and `sao pretrain` plumbing (tiny model, a few steps: no accuracy claims here)."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

import learner.pretrain as lp
from learner.models import CharTokenizer, ModelConfig, build_policy
from learner.models.packed import (
    Experts,
    PackedBatch,
    RMSNorm,
    group_sizes,
    lm_loss,
    make_batch,
    packed_loss,
)
from learner.pretrain import PretrainConfig, Progress, Threads, config_hash, cosine_lr, encode_demo, pretrain
from simulator.env import make_env
from simulator.scenario import load_scenario
from simulator.warmstart import demos, held_out_tasks, segments
from streamer.agent.rollouts import run_tasks

TINY = {"model": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "num_experts": 2,
                  "experts_per_token": 1, "expert_width": 32}}


def test_mixture_and_tag_dropout_follow_the_scenario():
    scn = load_scenario("default")  # string mixture reverse .55 / sort .4 / rotl .05, tag dropout .5
    sample = [d for d in itertools.islice(demos(scn, seed=0), 8000) if d.task.family == "string"]
    share = {c: sum(d.task.concept == c for d in sample) / len(sample) for c in ("reverse", "sort", "rotl")}
    # ~3400 string demos (weight 3 of 7): the sd of a share near .5 is sqrt(.25/3400) ~ .009; 4 sd tolerance
    assert share == pytest.approx({"reverse": 0.55, "sort": 0.4, "rotl": 0.05}, abs=0.036)
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


def test_held_out_tasks_are_untagged_pinned_and_apart_from_the_training_seeds():
    scn = load_scenario("default")
    phase0 = {f: c for f, c in scn.phases[0].concepts.items() if isinstance(c, str)}
    tasks = held_out_tasks(scn, phase0, 40, seed=0)
    assert [t.prompt for t in tasks] == [t.prompt for t in held_out_tasks(scn, phase0, 40, seed=0)]  # seeded
    assert [t.task_id for t in tasks[:2]] == ["warm-10000-0", "warm-10000-1"]  # the warm start trains on small seeds
    assert all(t.concept == phase0[t.family] and not t.prompt.startswith(t.concept + ":") for t in tasks)


def test_held_out_evaluation_runs_the_agents_episode_loop_with_an_untrained_policy():
    torch.manual_seed(0)
    tok = CharTokenizer()
    model = build_policy(ModelConfig(**TINY["model"]), tok.vocab_size, seed=0)
    scn = load_scenario("default")
    phase0 = {f: c for f, c in scn.phases[0].concepts.items() if isinstance(c, str)}
    seen = []
    ev = lp.evaluate(model, scn, phase0, 24, temperature=1.0, seed=0,
                     run_tasks=lambda *a, **k: seen.append(a) or run_tasks(*a, **k))
    (engine, _, tasks, s, _, latency), = seen  # one call: every task in flight, tool calls without latency
    assert (len(tasks), s.concurrency, s.max_new_tokens, s.max_turns, latency.sleep) == (24, 24, 24, 5, False)
    assert all(0.0 <= ev[k] <= 1.0 for k in ("reward", "success", "full_reward"))
    fams = {t.family for t in tasks}
    assert {f"reward/{f}" for f in fams} <= set(ev) and all(0.0 <= ev[f"reward/{f}"] <= 1.0 for f in fams)


def test_pretrain_trains_saves_and_reuses_the_cache(tmp_path):
    overrides = [f"cache_dir={tmp_path}", "steps=3", "batch_size=16", "micro_batches=2", "eval_every=0",
                 "threads=1"]
    from streamer.wire.config import load_config

    cfg = load_config(PretrainConfig, None, overrides, base=TINY)
    logs: list[str] = []
    with pytest.raises(ValueError, match="run_tasks"):  # the held-out evaluation needs the agents' episode loop
        pretrain(cfg, log=logs.append)
    assert logs == []  # refused before training
    path = pretrain(cfg, log=logs.append, run_tasks=run_tasks)
    assert path.name == f"warmstart-{config_hash(cfg, load_scenario_text())}"
    assert (path / "model.safetensors").is_file() and (path / "sao_tokenizer.json").is_file()
    meta = json.loads((path / "pretrain.json").read_text())
    assert meta["config"]["steps"] == 3 and math.isfinite(meta["seconds"])
    # the machine's kernels are part of what fixes the bits: the build says which it ran on
    assert meta["kernels"]["torch"] == torch.__version__
    assert meta["kernels"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert pretrain(cfg, log=logs.append) == path and logs[-1].startswith("pretrain: reusing")  # nothing to evaluate
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def load_scenario_text() -> str:
    from simulator.scenario import resolve_path

    return resolve_path("default").read_text()


def test_packed_loss_equals_the_hf_forward_loss_and_gradients():
    # top-2 of 4 experts and grouped-query attention, sequences of mixed lengths (tool episodes are the longest)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=4, experts_per_token=2,
                      expert_width=16)
    tok = CharTokenizer()
    model = build_policy(cfg, tok.vocab_size, seed=1).train()
    sample = itertools.islice(demos(load_scenario("default"), seed=5), 24)
    items = [encode_demo(tok, d.task.prompt, d.text) for d in sample]
    assert len({len(ids) for ids, _ in items}) > 5
    ids, mask, attn = make_batch(tok, items)  # the reference: HF forward, one right-padded batch
    ref = lm_loss(model, ids, mask, attn)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for groups in (1, 5):  # attention in one padded group or several
        loss = packed_loss(model, PackedBatch(items, groups))
        loss.backward()
        assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
        for p, g in zip(model.parameters(), ref_grads):
            torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)
        model.zero_grad()



def test_group_sizes_pad_least_of_all_splits():
    def slots(lens, sizes):
        ends = list(itertools.accumulate(sizes))
        return sum(size * lens[end - 1] for size, end in zip(sizes, ends))

    for lens, groups in [([3, 3, 4, 9, 9, 30], 3), ([1, 2, 3, 4, 5, 6, 7], 2), ([5], 4), ([2, 2, 2, 8], 4)]:
        sizes = group_sizes(lens, groups)
        assert len(sizes) == min(groups, len(lens)) and min(sizes) > 0 and sum(sizes) == len(lens)
        splits = itertools.combinations(range(1, len(lens)), len(sizes) - 1)
        best = min(slots(lens, [b - a for a, b in zip((0, *cut), (*cut, len(lens)))]) for cut in splits)
        assert slots(lens, sizes) == best
    assert group_sizes([3, 3, 4, 9, 9, 30], 3) == [3, 2, 1]  # the long one alone, not [2, 2, 2]

def _value_and_grads(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("shape, wshape", [((5, 8), (8,)), ((5, 3, 4), (3, 4))])
def test_rms_norm_function_matches_the_plain_expression(shape, wshape):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(shape[0], 2 * math.prod(shape[1:]), generator=gen)
    x = base[:, :math.prod(shape[1:])].view(shape)  # a strided view, as q and k are in packed_loss
    w, g = torch.randn(wshape, generator=gen), torch.randn(shape, generator=gen)

    def plain(x, w):  # HF's Qwen3MoeRMSNorm
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    got = _value_and_grads(lambda x, w: RMSNorm.apply(x, w, 1e-6), [x, w], g)
    for a, b in zip(got, _value_and_grads(plain, [x, w], g)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert torch.autograd.gradcheck(lambda x, w: RMSNorm.apply(x, w, 1e-6),
                                    (x.double().requires_grad_(), w.double().requires_grad_()))


def test_experts_function_matches_the_plain_expression():
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 4]  # the second expert gets no rows: no gradient, as the plain expression skipping it gives
    x, g = torch.randn(7, 4, generator=gen), torch.randn(7, 4, generator=gen)
    weights = [torch.randn(shape, generator=gen) for _ in counts for shape in ((5, 4), (5, 4), (4, 5))]

    def plain(x, *w):
        return torch.cat([F.linear(F.silu(F.linear(xe, w[3 * e])) * F.linear(xe, w[3 * e + 1]), w[3 * e + 2])
                          for e, xe in enumerate(x.split(counts)) if counts[e]])

    def grads(fn, dtype=torch.float32):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in [x, *weights]]
        out = fn(*leaves)
        out.backward(g.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    got, want = grads(lambda x, *w: Experts.apply(x, counts, *w)), grads(plain)
    assert got[5:8] == [None] * 3 and want[5:8] == [None] * 3
    for a, b in zip(got[:5] + got[8:], want[:5] + want[8:]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    double = [t.double().requires_grad_() for t in [x, *weights]]
    assert torch.autograd.gradcheck(lambda x, *w: Experts.apply(x, counts, *w), tuple(double))


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_in_place_on_a_terminal_and_plain_lines_in_logs():
    tty = FakeTTY()
    bar = Progress(40, stream=tty)
    for step in range(1, 41):
        bar.update(step, loss=0.5, reward=0.9 if step == 40 else None)
    out = tty.getvalue()
    assert out.startswith("\rwarm start   1/40 [") and out.endswith("\n") and out.count("\n") == 1
    last = out.rstrip("\n").split("\r")[-1]
    assert last.startswith("warm start  40/40 [####################] 100% loss 0.500 reward 0.900 ")
    assert "steps/s ETA 0s" in last
    log = io.StringIO()
    bar = Progress(40, stream=log, every=3600)  # logs: first and last step only within the hour
    for step in range(1, 41):
        bar.update(step, loss=1.0)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log.getvalue()
    assert lines[0].startswith("warm start   1/40 [....................]   2% loss 1.000 ") and " ETA " in lines[0]
    assert lines[1].startswith("warm start  40/40 [####################] 100%")


def test_threads_auto_falls_back_to_one_when_the_probe_says_so(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(lp, "available_cores", lambda: 8)
        monkeypatch.setattr(lp, "_probe", lambda n: 1.0 if n == 1 else 9.0)  # busy cores: many threads slower
        t = Threads(0)
        assert t.max == 4
        t.check(0)
        assert torch.get_num_threads() == 1 and t.history == [[0, 1]]
        monkeypatch.setattr(lp, "_probe", lambda n: 1.0 / n)  # quiet again: the next probe (every 30 s) sees it
        t.checked -= 31
        t.check(7)
        assert torch.get_num_threads() == 4 and t.history == [[0, 1], [7, 4]]
        t.done(1.0, 1000)
        t.done(2.5, 1000)  # slower, yet not enough to probe again before 30 s
        assert t.checked > 0
        t.done(3.5, 1000)  # 3x slower per token than the best step: probe before the next one
        monkeypatch.setattr(lp, "_probe", lambda n: 1.0 if n == 1 else 9.0)
        t.check(9)
        assert torch.get_num_threads() == 1 and t.history[-1] == [9, 1]
        monkeypatch.setattr(lp, "_probe", lambda n: 1.0 if n == 1 else 0.95)  # quiet but barely faster: keep 4
        t.checked -= 31
        t.check(11)
        assert torch.get_num_threads() == 4 and t.history[-1] == [11, 4]
        monkeypatch.setattr(lp, "_probe", lambda n: 1.0 if n == 1 else 1.05)  # slower than one: 1
        t.checked -= 31
        t.check(12)
        assert torch.get_num_threads() == 1 and t.history[-1] == [12, 1]
        monkeypatch.setattr(lp, "_probe", lambda n: pytest.fail("threads=N is not probed"))
        Threads(2).check(0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_pretrain_shows_progress_and_evaluates_once_at_the_end(tmp_path, capsys):
    from streamer.wire.config import load_config

    cfg = load_config(PretrainConfig, None, [f"cache_dir={tmp_path}", "steps=4", "batch_size=8", "micro_batches=2",
                                             "eval_tasks=16"], base=TINY)
    assert PretrainConfig().eval_every == 0 and PretrainConfig().threads == 0  # defaults: end-only eval, auto threads
    logs: list[str] = []
    path = pretrain(cfg, log=logs.append, run_tasks=run_tasks)
    out = capsys.readouterr().out  # not a terminal under pytest: plain lines
    bar = [line for line in out.splitlines() if line.startswith("warm start ")]
    assert bar[0].startswith("warm start  1/4 [") and bar[-1].startswith("warm start  4/4 [####################] 100%")
    assert all(" loss " in line and " steps/s ETA " in line for line in bar) and " reward " in bar[-1]
    meta = json.loads((path / "pretrain.json").read_text())
    assert [row["step"] for row in meta["history"]] == [4]  # one evaluation, after the last step
    assert set(meta["history"][0]) >= {"reward", "reward/string", "seconds", "cpu_seconds", "eval_seconds"}
    assert logs[0].startswith("warm start: 4 steps of 8 demonstrations")
    assert logs[-2].startswith("warm start: held-out greedy reward ") and "string" in logs[-2]
    assert logs[-1] == f"pretrain: saved {path}"
    assert meta["threads"] and meta["threads"][0][0] == 0

    again = load_config(PretrainConfig, None, [f"cache_dir={tmp_path}", "steps=4", "batch_size=8", "micro_batches=2",
                                               "eval_tasks=16", "eval_every=2", "threads=1"], base=TINY)
    text = load_scenario_text()
    assert config_hash(dataclasses.replace(again, threads=0), text) == config_hash(cfg, text)  # evaluation: not keyed
    assert config_hash(again, text) != config_hash(cfg, text)  # a pinned thread count is a build of its own
    built = pretrain(again, out=tmp_path / "b", log=logs.append, run_tasks=run_tasks)
    meta = json.loads((built / "pretrain.json").read_text())
    assert [row["step"] for row in meta["history"]] == [2, 4]
    rebuilt = pretrain(again, out=tmp_path / "c", log=logs.append, run_tasks=run_tasks)  # pinned: the same bits again
    assert (rebuilt / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert meta["threads"] == [[0, 1]]

"""Throughput of one SAO learner step against a bare forward+backward of the same two models.

SAO step = value forward (its detached output gives the advantages, its graph the clipped value loss) +
policy log-probs and entropy + `policy_loss("sao")` + `value_loss` + two backward passes + two AdamW steps.
Bare = the same two forwards and backwards with a trivial loss, no advantages and no optimizer.
Goal: ratio (bare tokens/s over SAO tokens/s) <= 1.25. Prints and saves runs/bench/learner_step.json.
With `--lengths-from <run>/trajectories.parquet`, also the learner's own step (`learner.trainer.step.prepare` +
`update` on `LearnerConfig` defaults: length-sorted micro-batches, the KL reference's forward, the critic's
values from the update's own forward as the trainer takes them, fused AdamW) on
`--batch` trajectories whose prompt and response lengths are drawn from that run: the isolated figure
bench/pipeline.py compares the pipeline's learner with (same step, same batch shape, nothing else running).
With `--megatron`, also the learner's whole step (`learner.trainer.step.update`) on the megatron backend,
1 process EP1, 2 processes EP1 and 2 processes EP2 under torchrun, next to the same step on the torch
backend, all measured by bench/megatron_step.py's trainer rows (its own fixed batch: `--megatron-batch`
sequences of `--megatron-seq` tokens, so compare the megatron rows with that torch row, not with the
SAO/bare rows above); saved under the "megatron" key.

    .venv/bin/python bench/learner_step.py [--threads 2] [--batch 64] [--repeats 5] [--megatron]
                                           [--lengths-from runs/<run>/trajectories.parquet]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from learner.algorithms import place_reward, policy_loss, sao_advantages, value_loss
from learner.models import CharTokenizer, ValueModel, build_policy, logprobs_and_entropy, values


def make_batch(batch: int, seed: int = 0):
    """Right-padded prompt+response rows (prompt 16-32, response 16-48 tokens) with a response mask and rewards."""
    g = torch.Generator().manual_seed(seed)
    V = CharTokenizer().vocab_size
    prompt_len = torch.randint(16, 33, (batch,), generator=g)
    resp_len = torch.randint(16, 49, (batch,), generator=g)
    T = int((prompt_len + resp_len).max())
    ids = torch.randint(4, V, (batch, T), generator=g)
    attn = torch.zeros(batch, T, dtype=torch.long)
    resp = torch.zeros(batch, T, dtype=torch.float32)
    for i in range(batch):
        p, r = int(prompt_len[i]), int(resp_len[i])
        attn[i, :p + r] = 1
        resp[i, p:p + r] = 1
    ids = ids * attn
    rewards = torch.randint(0, 2, (batch,), generator=g).float()
    return ids, attn, resp, rewards


def sao_step(policy, critic, opt_p, opt_v, ids, attn, resp, rewards, old_logp) -> dict[str, float]:
    v = values(critic, ids, attn)
    adv, returns = sao_advantages(place_reward(rewards, resp), v.detach(), resp)
    logp, ent = logprobs_and_entropy(policy, ids, attn)
    p_loss, p_stats = policy_loss("sao", logp, old_logp, adv, resp)
    v_loss, _ = value_loss(v, v.detach(), returns, resp)
    opt_p.zero_grad(set_to_none=True)
    opt_v.zero_grad(set_to_none=True)
    p_loss.backward()
    v_loss.backward()
    opt_p.step()
    opt_v.step()
    return {"clip_frac": p_stats["clip_frac"], "entropy": float((ent.detach() * resp).sum() / resp.sum())}


def bare_step(policy, critic, ids, attn) -> None:
    policy.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    policy(input_ids=ids, attention_mask=attn, use_cache=False).logits.mean().backward()
    critic(ids, attn).mean().backward()


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up (allocator, first-call dispatch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run_lengths(path: str, batch: int, seed: int = 0) -> list[tuple[int, int]]:
    """`batch` (prompt, generated) token counts drawn from a run's trajectories.parquet."""
    import numpy as np
    import pandas as pd

    d = pd.read_parquet(path, columns=["n_tokens", "n_gen_tokens"])
    rows = d.iloc[np.random.default_rng(seed).integers(len(d), size=batch)]
    return [(int(n - g), int(g)) for n, g in zip(rows["n_tokens"], rows["n_gen_tokens"])]


def learner_row(lengths: list[tuple[int, int]], repeats: int, source: str) -> dict:
    """The trainer's own step (prepare + update, LearnerConfig defaults) on trajectories of these lengths."""
    from learner.config import LearnerConfig
    from learner.train import build_models
    from learner.trainer.batching import by_length, collate
    from learner.trainer.step import prepare, update
    from streamer.wire.schema import Trajectory

    cfg = LearnerConfig()
    models = build_models(cfg)
    g = torch.Generator().manual_seed(2)
    V = CharTokenizer().vocab_size
    trajs = [Trajectory(traj_id=str(i), task_id=str(i), family="f", concept="c", prompt_len=p,
                        tokens=torch.randint(4, V, (p + r,), generator=g).tolist(), loss_mask=[0] * p + [1] * r,
                        logprobs=[0.0] * p + [-1.0] * r, reward=float(i % 2)) for i, (p, r) in enumerate(lengths)]
    batch = collate(by_length(trajs))

    def step() -> None:
        update(cfg, models, batch, prepare(cfg, models, batch, values_from_update=True), train_policy=True)

    t = min(timed(step, repeats))
    return {"lengths_from": source, "batch": len(lengths), "tokens": batch.n_tokens, "learner_s": t,
            "learner_tokens_per_s": batch.n_tokens / t, "kl_coef": cfg.loss.kl_coef}


def megatron_rows(threads: int, steps: int, batch: int, seq: int) -> list[dict]:
    """bench/megatron_step.py --trainer rows: torch learner step, then megatron 1x EP1, 2x EP1, 2x EP2."""
    import sys

    repo = Path(__file__).resolve().parents[1]
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from bench import megatron_step as ms

    args = ms.parse(["--trainer", "--threads", str(threads), "--steps", str(steps), "--warmup", "1",
                     "--batch", str(batch), "--seq", str(seq)])
    out_dir = repo / "runs" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [ms.bench_torch_learner(args)]
    print(ms._line(rows[0]), flush=True)
    for nproc, ep in ((1, 1), (2, 1), (2, 2)):
        rows.append(ms.launch(nproc, ep, args, out_dir / f"learner_step_megatron_{nproc}x_ep{ep}.json"))
        print(ms._line(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="runs/bench/learner_step.json")
    ap.add_argument("--megatron", action="store_true", help="add the megatron backend rows (EP=1, EP=2; torchrun)")
    ap.add_argument("--megatron-batch", type=int, default=16, help="sequences per megatron-row step")
    ap.add_argument("--megatron-seq", type=int, default=64, help="tokens per sequence in the megatron rows")
    ap.add_argument("--lengths-from", default="", help="a run's trajectories.parquet: add the learner's own step "
                                                       "on a batch of that run's lengths")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    policy = build_policy(seed=0).train()
    critic = ValueModel.from_policy(policy).train()
    # fused=True: one kernel for all parameters; the default per-tensor loop costs ~14x more on CPU (28 ms vs 2 ms).
    opt_p = torch.optim.AdamW(policy.parameters(), lr=3e-4, fused=True)
    opt_v = torch.optim.AdamW(critic.parameters(), lr=1e-3, fused=True)
    ids, attn, resp, rewards = make_batch(args.batch)
    with torch.no_grad():  # behaviour log-probs: the current policy's, slightly perturbed (as if one version old)
        old_logp, _ = logprobs_and_entropy(policy, ids, attn)
        old_logp = old_logp + 0.05 * torch.randn(old_logp.shape, generator=torch.Generator().manual_seed(1))
    tokens = int(attn.sum())
    # Interleaved rounds, min over them: the machine is shared, and the minimum is the least disturbed figure.
    bare_times, sao_times = [], []
    for _ in range(args.repeats):
        bare_times += timed(lambda: bare_step(policy, critic, ids, attn), 1)
        sao_times += timed(lambda: sao_step(policy, critic, opt_p, opt_v, ids, attn, resp, rewards, old_logp), 1)
    t_bare, t_sao = min(bare_times), min(sao_times)
    result = {
        "bench": "learner_step", "load_avg_1m": os.getloadavg()[0],
        "losses": "learner.algorithms policy_loss('sao') + value_loss (clipped)",
        "threads": args.threads, "batch": args.batch, "tokens": tokens, "seq_len": int(ids.shape[1]),
        "bare_s": t_bare, "sao_s": t_sao, "bare_tokens_per_s": tokens / t_bare, "sao_tokens_per_s": tokens / t_sao,
        "ratio_sao_over_bare": t_sao / t_bare, "goal_ratio_max": 1.25,
        "ratio_of_medians": statistics.median(sao_times) / statistics.median(bare_times),
        "bare_times_s": bare_times, "sao_times_s": sao_times,
    }
    print(f"tokens/step {tokens}  bare fwd+bwd {tokens / t_bare:,.0f} tok/s ({t_bare:.3f} s)  "
          f"SAO step {tokens / t_sao:,.0f} tok/s ({t_sao:.3f} s)  ratio {t_sao / t_bare:.3f} (goal <= 1.25)",
          flush=True)
    if args.lengths_from:
        row = learner_row(run_lengths(args.lengths_from, args.batch), args.repeats, args.lengths_from)
        result["learner"] = row
        print(f"learner's own step on {row['batch']} trajectories of {args.lengths_from}'s lengths: "
              f"{row['tokens']} tokens, {row['learner_tokens_per_s']:,.0f} tok/s ({row['learner_s']:.3f} s)",
              flush=True)
    if args.megatron:
        print(f"learner step, torch vs megatron backends ({args.megatron_batch} x {args.megatron_seq} tokens, "
              f"median of {args.repeats} steps):", flush=True)
        result["megatron"] = megatron_rows(args.threads, args.repeats, args.megatron_batch, args.megatron_seq)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

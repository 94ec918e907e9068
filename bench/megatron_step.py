"""Throughput of one SAO policy step: megatron backend (EP=1, EP=2 under torchrun) vs the HF model.

    .venv/bin/python bench/megatron_step.py                 # CPU: HF torch, megatron 1x EP1, 2x EP1, 2x EP2
    .venv/bin/python bench/megatron_step.py --trainer       # the same rows for the learner's whole step
    torchrun --nproc_per_node N bench/megatron_step.py --worker --ep N --size gpu --dtype bfloat16

A step = forward (log-probs), SAO loss, backward, gradient all-reduce (dense over data parallel,
experts over expert-data parallel), global-norm clip, AdamW. The global batch (`--batch`
sequences of `--seq` tokens) is split over the ranks, so tokens/s compare like for like.
Model FLOPs per token (PaLM appendix B convention, https://arxiv.org/abs/2204.02311):
6 * N_active (matmul weights a token passes through: attention, router, top-k experts, LM head)
+ 12 * L * T * Q * D (attention scores and values, no causal discount). MFU = achieved / peak.
With `--trainer` a step is what `sao learn` runs per batch (learner.trainer.step: critic forward
and GAE on the whole batch, clipped value loss + SAO loss on this rank's rows, reduced clip, two
AdamW steps), on the torch backend and on the megatron backend (the rows bench/learner_step.py
would hold next to its torch row); FLOPs count the policy only. Prints a table and saves JSON
under runs/bench/ (megatron_step.json, megatron_learner_step.json).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # ModelConfig overrides
    "tiny": {},  # CALIBRATION.md: 4 layers, hidden 128, 8 experts top-2, width 256
    "gpu": dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4, num_experts=16,
                experts_per_token=2, expert_width=1024, max_positions=4096),
}
PEAK_TFLOPS = {  # dense tensor-core peaks of the usual training GPUs, per dtype
    "H200": {"bfloat16": 989.0, "float32": 67.0}, "H100": {"bfloat16": 989.0, "float32": 67.0},
    "A100": {"bfloat16": 312.0, "float32": 19.5},
}


def model_flops_per_token(hf_cfg, seq: int) -> float:
    h, L = hf_cfg.hidden_size, hf_cfg.num_hidden_layers
    d = getattr(hf_cfg, "head_dim", None) or h // hf_cfg.num_attention_heads
    q, g = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads
    attn = h * q * d + 2 * h * g * d + q * d * h
    moe = h * hf_cfg.num_experts + hf_cfg.num_experts_per_tok * 3 * h * hf_cfg.moe_intermediate_size
    n_active = L * (attn + moe) + hf_cfg.vocab_size * h
    return 6.0 * n_active + 12.0 * L * seq * q * d


def peak_tflops(dtype: str, override: float | None) -> float | None:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((p[dtype] for k, p in PEAK_TFLOPS.items() if k in name), None)


def make_batch(rows: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, seq), generator=g)
    mask = torch.ones(rows, seq, dtype=torch.long)
    loss_mask = mask.clone()
    loss_mask[:, : seq // 4] = 0  # a prompt quarter
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
            "advantages": torch.randn(rows, seq, generator=g)}


def sao(logp, b):
    from learner.algorithms import policy_loss

    return policy_loss("sao", logp, b["old_logp"], b["advantages"], b["loss_mask"])


def build_hf(size: str):
    from learner.models.config import ModelConfig
    from learner.models.policy import build_policy

    return build_policy(ModelConfig(**SIZES[size]), seed=0)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step, warmup: int, steps: int, barrier=lambda: None) -> list[float]:
    times = []
    for i in range(warmup + steps):
        barrier()
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def bench_torch(args) -> dict:
    """The HF model in one process: the torch backend's step (same loss, clip, AdamW)."""
    from learner.models.scoring import token_logprobs

    torch.set_num_threads(args.threads)
    policy = build_hf(args.size).train()
    b = make_batch(args.batch, args.seq, policy.config.vocab_size, seed=0)
    with torch.no_grad():
        b["old_logp"] = token_logprobs(policy, b["input_ids"], b["attention_mask"])
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)

    def step():
        opt.zero_grad(set_to_none=True)
        sao(token_logprobs(policy, b["input_ids"], b["attention_mask"]), b)[0].backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()

    times = time_steps(step, args.warmup, args.steps)
    return _summary("torch (HF)", 1, 1, times, args, policy.config, args.threads)


def learner_batch(args, policy):
    """A learner Batch of the global batch (every rank builds the same one) with behaviour
    log-probs = the policy's own + N(0, 0.05^2) and 0/1 rewards."""
    from learner.models.scoring import token_logprobs
    from learner.trainer.batching import Batch

    b = make_batch(args.batch, args.seq, policy.config.vocab_size, seed=0)
    g = torch.Generator().manual_seed(1)
    lm = b["loss_mask"].float()
    with torch.no_grad():
        old = token_logprobs(policy, b["input_ids"], b["attention_mask"]) + 0.05 * torch.randn(lm.shape, generator=g)
    rewards = (torch.rand(args.batch, generator=g) > 0.5).float()
    return Batch(b["input_ids"], b["attention_mask"], lm, torch.where(lm.bool(), old, 0.0), rewards, [])


def learner_cfg(args):
    from learner.config import LearnerConfig

    cfg = LearnerConfig()

    cfg.loss.kl_coef = 0.0  # the KL anchor is torch-only (LearnerConfig refuses it on megatron)
    cfg.batch.micro_batch = args.batch  # one forward per model and rank, as the policy-step rows
    return cfg


def bench_torch_learner(args) -> dict:
    from learner.models.value import ValueModel
    from learner.trainer.step import build_optimizers, prepare, update

    torch.set_num_threads(args.threads)
    policy = build_hf(args.size).train()
    value = ValueModel.from_policy(policy, seed=1).train()
    cfg, batch = learner_cfg(args), learner_batch(args, policy)
    models = build_optimizers(cfg, policy, value)
    times = time_steps(lambda: update(cfg, models, batch, prepare(cfg, models, batch), True), args.warmup, args.steps)
    return _summary("torch learner step", 1, 1, times, args, policy.config, args.threads)


def _worker_learner(args, policy):
    """The megatron learner step of `sao learn` on this rank; returns (step function, device)."""
    from learner.backends.megatron.learner import MegatronOptions, megatron_trainer_models
    from learner.models.value import ValueModel
    from learner.trainer.ranks import RankGroup
    from learner.trainer.step import prepare, update

    value = ValueModel.from_policy(policy, seed=1).train()
    cfg, batch = learner_cfg(args), learner_batch(args, policy)
    models, lrn = megatron_trainer_models(cfg, policy, value, MegatronOptions(args.ep, args.dtype))
    batch = batch.to(lrn.device)
    shard = RankGroup(lrn.device).shard(args.batch)
    return lambda: update(cfg, models, batch, prepare(cfg, models, batch), True, shard), lrn.device


def worker(args) -> int:
    import torch.distributed as dist

    if args.trainer:
        return _run_worker(args, "megatron learner step")

    from learner.backends.megatron.learner import MegatronLearner, MegatronOptions, OptimSettings

    torch.set_num_threads(args.threads)
    policy = build_hf(args.size)
    opts = MegatronOptions(expert_parallel=args.ep, dtype=args.dtype)
    lrn = MegatronLearner(policy, None, opts, OptimSettings(lr=1e-5, grad_clip=1.0), sao)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the world size {world}")
    b = make_batch(args.batch // world, args.seq, policy.config.vocab_size, seed=rank)
    with torch.no_grad():
        b["old_logp"] = lrn.forward_logprobs(b["input_ids"], b["attention_mask"]).float().cpu()
    times = time_steps(lambda: lrn.policy_step(b), args.warmup, args.steps, dist.barrier)
    return _report(args, "megatron", times, lrn.device, policy.config)


def _run_worker(args, name: str) -> int:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    policy = build_hf(args.size).train()
    step, device = _worker_learner(args, policy)
    return _report(args, name, time_steps(step, args.warmup, args.steps, dist.barrier), device, policy.config)


def _report(args, name: str, times: list[float], device, hf_cfg) -> int:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor(times, dtype=torch.float64, device=device)  # NCCL: device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    if rank == 0:
        label = f"{name} {world}x EP{args.ep}" + (" (cuda)" if torch.cuda.is_available() else "")
        res = _summary(label, world, args.ep, t.cpu().tolist(), args, hf_cfg, args.threads)
        print(_line(res), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=2))
    from learner.backends.megatron import parallel

    parallel.shutdown()
    return 0


def _summary(label, world, ep, times, args, hf_cfg, threads) -> dict:
    step_s = sorted(times)[len(times) // 2]
    tokens = args.batch * args.seq
    flops = model_flops_per_token(hf_cfg, args.seq)
    achieved = flops * tokens / step_s / 1e12
    peak = peak_tflops(args.dtype, args.peak_tflops)
    return {"backend": label, "processes": world, "ep": ep, "threads_per_process": threads,
            "size": args.size, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
            "tokens_per_step": tokens, "step_s_median": step_s, "step_s_all": times,
            "tokens_per_s": tokens / step_s, "model_flops_per_token": flops,
            "achieved_tflops": achieved, "peak_tflops": peak,
            "mfu": achieved / peak if peak else None}


def _line(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.2f}%" if r["mfu"] is not None else "n/a (no peak for CPU)"
    return (f"{r['backend']:<28} step {r['step_s_median'] * 1e3:8.1f} ms  "
            f"{r['tokens_per_s']:10.0f} tok/s  {r['achieved_tflops'] * 1e3:8.2f} GFLOP/s  MFU {mfu}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, ep: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker",
           "--ep", str(ep), "--size", args.size, "--dtype", args.dtype, "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(max(1, args.threads // nproc)), "--out", str(out)] + (["--trainer"] if args.trainer else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // nproc))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun {nproc}x EP{ep} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help="run one config (under torchrun)")
    ap.add_argument("--trainer", action="store_true", help="time the learner's whole step (critic + policy)")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch", type=int, default=16, help="global sequences per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads in all (split over ranks)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the GPU peak")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args)
    out_dir = REPO / "runs" / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "megatron_learner_step" if args.trainer else "megatron_step"
    rows = [bench_torch_learner(args) if args.trainer else bench_torch(args)]
    print(_line(rows[0]), flush=True)
    for nproc, ep in ((1, 1), (2, 1), (2, 2)):
        rows.append(launch(nproc, ep, args, out_dir / f"{name}_{nproc}x_ep{ep}.json"))
        print(_line(rows[-1]), flush=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"rows": rows, "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
                               indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())

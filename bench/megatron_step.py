"""Throughput of one SAO policy step: megatron backend (EP=1, EP=2 under torchrun) vs the HF model.

    .venv/bin/python bench/megatron_step.py                 # CPU: HF torch, megatron 1x EP1, 2x EP1, 2x EP2
    .venv/bin/python bench/megatron_step.py --trainer       # the same rows for the learner's whole step
    .venv/bin/python bench/megatron_step.py --layouts       # the policy step at every layout of LAYOUTS (TP, PP,
        EP, ZeRO-1) with tokens/s and memory per rank -> docs/results/megatron_step.json (GPU: --out ..._gpu.json)
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
    models, lrn = megatron_trainer_models(cfg, policy, value, MegatronOptions(
        args.ep, args.dtype, tensor_parallel=args.tp, shard_optimizer=args.shard_optimizer))
    batch = batch.to(lrn.device)
    shard = RankGroup(lrn.device, dp=(lrn.layout["dp_rank"], lrn.layout["dp"])).shard(args.batch)
    return lambda: update(cfg, models, batch, prepare(cfg, models, batch), True, shard), lrn.device


def worker(args) -> int:
    import torch.distributed as dist

    if args.trainer:
        return _run_worker(args, "megatron learner step")

    from learner.backends.megatron.learner import MegatronLearner, MegatronOptions, OptimSettings

    torch.set_num_threads(args.threads)
    policy = build_hf(args.size)
    opts = MegatronOptions(expert_parallel=args.ep, dtype=args.dtype, tensor_parallel=args.tp,
                           pipeline_parallel=args.pp, micro_batches=args.micro_batches,
                           shard_optimizer=args.shard_optimizer)
    lrn = MegatronLearner(policy, None, opts, OptimSettings(lr=1e-5, grad_clip=1.0), sao)
    # the ranks of one replica (TP, PP) share its rows: split by the data-parallel rank and size, as ranks.py does
    dp_rank, dp = lrn.layout["dp_rank"], lrn.layout["dp"]
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} is not divisible by the data-parallel size {dp}")
    b = make_batch(args.batch // dp, args.seq, policy.config.vocab_size, seed=dp_rank)
    with torch.no_grad():
        b["old_logp"] = lrn.forward_logprobs(b["input_ids"], b["attention_mask"]).float().cpu()
    times = time_steps(lambda: lrn.policy_step(b), args.warmup, args.steps, dist.barrier)
    return _report(args, "megatron", times, lrn.device, policy.config, _memory(lrn))


def _memory(lrn) -> list[float]:
    """MiB on this rank: [peak (GPU: max allocated; CPU: the process's peak RSS, imports included), the policy's
    weights, its AdamW state]."""
    import resource

    from learner.backends.megatron.zero import state_bytes

    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    weights = sum(t.numel() * t.element_size() for t in lrn.policy.parameters())
    return [x / 2**20 for x in (peak, weights, state_bytes(lrn.opt))]


def _run_worker(args, name: str) -> int:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    policy = build_hf(args.size).train()
    step, device = _worker_learner(args, policy)
    return _report(args, name, time_steps(step, args.warmup, args.steps, dist.barrier), device, policy.config)


def _report(args, name: str, times: list[float], device, hf_cfg, memory: list[float] | None = None) -> int:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor(times, dtype=torch.float64, device=device)  # NCCL: device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    mem = None
    if memory is not None:
        mine = torch.tensor(memory, dtype=torch.float64, device=device)
        mem = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(mem, mine)
    if rank == 0:
        label = f"{name} {world}x {layout_name(args)}" + (" (cuda)" if torch.cuda.is_available() else "")
        res = _summary(label, world, args.ep, t.cpu().tolist(), args, hf_cfg, args.threads)
        res.update(tp=args.tp, pp=args.pp, shard_optimizer=args.shard_optimizer)
        if mem is not None:  # per rank, in rank order
            per = [m.cpu().tolist() for m in mem]
            res.update(peak_mib_per_rank=[r[0] for r in per], weights_mib_per_rank=[r[1] for r in per],
                       optimizer_state_mib_per_rank=[r[2] for r in per],
                       peak_is="torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "peak RSS")
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


def layout_name(args) -> str:
    parts = [f"TP{args.tp}"] * (args.tp > 1) + [f"PP{args.pp}"] * (args.pp > 1) + [f"EP{args.ep}"]
    return " ".join(parts) + (" ZeRO-1" if args.shard_optimizer else "")


def _line(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.2f}%" if r["mfu"] is not None else "n/a (no peak for CPU)"
    return (f"{r['backend']:<28} step {r['step_s_median'] * 1e3:8.1f} ms  "
            f"{r['tokens_per_s']:10.0f} tok/s  {r['achieved_tflops'] * 1e3:8.2f} GFLOP/s  MFU {mfu}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, ep: int, args, out: Path, layout: tuple[int, int, bool, int] = (1, 1, False, 1)) -> dict:
    """One torchrun of `nproc` ranks; `layout`: (TP, PP, shard_optimizer, micro-batches)."""
    tp, pp, zero, micro = layout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker",
           "--ep", str(ep), "--tp", str(tp), "--pp", str(pp), "--micro-batches", str(micro),
           "--size", args.size, "--dtype", args.dtype, "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(max(1, args.threads // nproc)), "--out", str(out)] + (["--trainer"] if args.trainer else [])
    cmd += ["--shard-optimizer"] if zero else []
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // nproc))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun {nproc}x EP{ep} TP{tp} PP{pp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


# (ranks, EP, (TP, PP, shard_optimizer, micro-batches)): the layouts of 1 and 2 ranks megatron-core runs on CPU
# with gloo ((PP 2, EP 2) needs 4 ranks: EP x PP must divide the world)
LAYOUTS = [(1, 1, (1, 1, False, 1)), (2, 1, (1, 1, False, 1)), (2, 1, (1, 1, True, 1)), (2, 2, (1, 1, False, 1)),
           (2, 1, (2, 1, False, 1)), (2, 2, (2, 1, False, 1)), (2, 1, (1, 2, False, 4))]


def bench_layouts(args) -> int:
    """The policy step at each layout of LAYOUTS that fits the machine (GPU: ranks <= GPUs); writes `args.out`."""
    ngpu = torch.cuda.device_count()
    tmp = REPO / "runs" / "bench" / "megatron_layouts"
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    for nproc, ep, lay in LAYOUTS:
        if ngpu and nproc > ngpu:
            continue
        rows.append(launch(nproc, ep, args, tmp / f"{nproc}_{ep}_{'_'.join(map(str, lay))}.json", lay))
        print(_line(rows[-1]), "peak MiB per rank", [round(m) for m in rows[-1]["peak_mib_per_rank"]], flush=True)
    device = torch.cuda.get_device_name() if ngpu else f"CPU ({os.cpu_count()} cores), gloo"
    out = Path(args.out or REPO / "docs" / "results" / "megatron_step.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "command": "bench/megatron_step.py --layouts " + " ".join(
        sys.argv[2:]), "global_batch": args.batch, "seq": args.seq, "threads_in_all": args.threads,
        "load_avg_1m": os.getloadavg()[0], "rows": rows}, indent=2))
    print(f"saved {out}")
    return 0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help="run one config (under torchrun)")
    ap.add_argument("--trainer", action="store_true", help="time the learner's whole step (critic + policy)")
    ap.add_argument("--layouts", action="store_true", help="every layout of LAYOUTS -> docs/results/megatron_step.json")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=1, help="pipeline micro-batches (PP > 1)")
    ap.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1 AdamW state over data parallelism")
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
    if args.layouts:
        return bench_layouts(args)
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

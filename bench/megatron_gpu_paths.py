"""What the megatron backend leaves to a GPU (issue 48): megatron-core's TransformerEngine layer spec (grouped GEMM
for the experts) and its DistributedOptimizer, timed on bench/megatron_step.py's model, under torchrun on NCCL.

    torchrun --nproc_per_node N bench/megatron_gpu_paths.py --ep N --size gpu --dist-opt --out runs/bench/x.json

The backend itself trains with the local spec and a torch AdamW (ZeRO-1 of its own, learner/backends/megatron/
zero.py), because on CPU megatron-core's DistributedOptimizer refuses non-CUDA parameters and TransformerEngine does
not exist; its HF converter maps the local spec's names only. So this bench builds the GPTModel from the same
TransformerConfig (`model.transformer_config`) at random init: the TE spec with `moe_grouped_gemm` when
transformer_engine imports (else the local spec, recorded as such), wrapped in megatron-core's
DistributedDataParallel, stepped by `get_megatron_optimizer` (Adam, bf16 params with fp32 main params, distributed
over data parallelism with --dist-opt). A step: forward with labels (vocab-parallel cross entropy), a
policy-gradient surrogate (-log p x advantage over the completion tokens, the FLOPs of the SAO loss), backward,
`finalize_model_grads`, the optimizer step (clip 1.0). Prints tokens/s, MFU (bench/megatron_step.py's FLOPs and
peaks), peak memory and the optimizer's memory per rank, and checks the latter against its arithmetic: Adam with
fp32 main params holds 12 bytes per parameter (main copy, two moments) over the ranks that share it (dense: data
parallel; experts: expert data parallel) with --dist-opt, 12 (fp32: 8) on every rank without.
On CPU (no CUDA: gloo, fp32, local spec) the same loop runs with the backend's CPU shims as a smoke test
(tests/test_megatron_gpu_paths.py), up to the optimizer: megatron-core's DDP and finalize_model_grads run there, its
optimizers (the DistributedOptimizer and the plain one alike) allocate on device="cuda" and do not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# run as a script, bench/ comes first on sys.path and its modules (pipeline, weights, transport, common) could shadow
# others' top-level ones: the repository root instead
sys.path = [str(REPO)] + [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]

from bench.megatron_step import SIZES, model_flops_per_token, peak_tflops  # noqa: E402


def has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build(hf_cfg, dtype: torch.dtype, te: bool):
    """GPTModel over `hf_cfg` on this rank: the TE spec with grouped GEMM (`te`) or the backend's local spec."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from learner.backends.megatron.model import _sp_norms, transformer_config

    cfg = transformer_config(hf_cfg, dtype)
    cfg.moe_grouped_gemm = te
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=te, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec if te else _sp_norms(spec),
                     vocab_size=hf_cfg.vocab_size, max_sequence_length=hf_cfg.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     parallel_output=True, share_embeddings_and_output_weights=bool(hf_cfg.tie_word_embeddings),
                     position_embedding_type="rope", rotary_base=hf_cfg.rope_theta)
    return cfg, model.to(dtype=dtype)


def expected_optimizer_bytes(model, dtype: torch.dtype, dist_opt: bool) -> float:
    """Adam's bytes on this rank: fp32 main params (bf16 only) and two fp32 moments per parameter, each parameter's
    share over its data-parallel group with the distributed optimizer (megatron pads buckets: a few % more)."""
    from megatron.core import parallel_state as ps

    per = 12 if dtype == torch.bfloat16 else 8
    dp, edp = ps.get_data_parallel_world_size(), ps.get_expert_data_parallel_world_size()
    total = 0.0
    for p in model.parameters():
        expert = not getattr(p, "allreduce", True)  # megatron marks expert parameters allreduce=False
        total += per * p.numel() / ((edp if expert else dp) if dist_opt else 1)
    return total


def run(args) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from learner.backends.megatron import parallel
    from learner.models.config import ModelConfig, to_hf_config
    from learner.models.tokenizer import CharTokenizer

    cuda = torch.cuda.is_available()
    if args.dist_opt and not cuda:
        raise SystemExit("--dist-opt: megatron-core's DistributedOptimizer accepts only CUDA parameters")
    dtype = getattr(torch, args.dtype)
    te = has_te() and cuda and not args.local_spec
    parallel.init(expert_parallel=args.ep, tensor_parallel=args.tp)
    hf_cfg = to_hf_config(ModelConfig(**SIZES[args.size]), CharTokenizer().vocab_size)
    dev = parallel.device()
    cfg, model = build(hf_cfg, dtype, te)
    model = model.to(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.dist_opt), model)
    before_opt = torch.cuda.memory_allocated() if cuda else 0
    # megatron-core's optimizers allocate on device="cuda" (FP32Optimizer's scale too): the CPU smoke stops before
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-5, bf16=dtype == torch.bfloat16, params_dtype=dtype, clip_grad=1.0,
        use_distributed_optimizer=args.dist_opt), [ddp]) if cuda else None
    dp = ps.get_data_parallel_world_size()
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} is not divisible by the data-parallel size {dp}")
    g = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    rows = args.batch // dp
    ids = torch.randint(4, hf_cfg.vocab_size, (rows, args.seq + 1), generator=g).to(dev)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    pos = torch.arange(args.seq, device=dev).unsqueeze(0).expand(rows, -1)
    adv = torch.randn(rows, args.seq, generator=g).to(dev)
    mask = torch.ones(rows, args.seq, device=dev)
    mask[:, : args.seq // 4] = 0  # a prompt quarter

    def step():
        ddp.zero_grad_buffer()
        if opt is not None:
            opt.zero_grad()
        nll = ddp(inputs, pos, None, labels=labels)  # [rows, seq]: -log p(next token), fp32
        ((nll * adv * mask).sum() / mask.sum()).backward()
        finalize_model_grads([ddp])
        if opt is None:
            return True, sum(float(p.main_grad.float().square().sum()) for p in ddp.parameters()) ** 0.5
        ok, grad_norm, _ = opt.step()
        return ok, grad_norm

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    times, state_bytes = [], None
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        ok, grad_norm = step()
        sync()
        if i == 0 and cuda:  # Adam's state exists after its first step; activations are freed by then
            state_bytes = torch.cuda.memory_allocated() - before_opt
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    step_s = sorted(t.tolist())[len(times) // 2]
    tokens = args.batch * args.seq
    flops = model_flops_per_token(hf_cfg, args.seq)
    achieved = flops * tokens / step_s / 1e12
    peak = peak_tflops(args.dtype, args.peak_tflops)
    expected = expected_optimizer_bytes(model, dtype, args.dist_opt)
    mine = torch.tensor([torch.cuda.max_memory_allocated() if cuda else 0, state_bytes or 0, expected],
                        dtype=torch.float64, device=dev) / 2**20
    per = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(per, mine)
    per = [p.tolist() for p in per]
    spec = "transformer_engine (grouped GEMM)" if te else "local" if has_te() else "local (no transformer_engine)"
    return {"spec": spec, "backend": dist.get_backend(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "ranks": dist.get_world_size(), "ep": args.ep, "tp": args.tp, "dp": dp, "dist_opt": args.dist_opt,
            "local_spec": args.local_spec, "size": args.size, "dtype": args.dtype, "batch": args.batch,
            "seq": args.seq, "step_s_median": step_s,
            "tokens_per_s": tokens / step_s, "achieved_tflops": achieved, "peak_tflops": peak,
            "mfu": achieved / peak if peak else None, "last_step_ok": bool(ok),
            "grad_norm": None if grad_norm is None else float(grad_norm),  # CPU: rank 0's own gradients
            "peak_mib_per_rank": [p[0] for p in per], "optimizer_mib_per_rank": [p[1] for p in per] if cuda else None,
            "optimizer_mib_expected_per_rank": [p[2] for p in per]}


def checks(r: dict) -> dict:
    """What a pass is (None: not checkable here): the step ran and its gradient norm is finite; on CUDA, NCCL; the
    TE spec wherever transformer_engine imports (unless --local-spec); Adam's memory per rank within 10% + 64 MiB of
    `expected_optimizer_bytes` (bucket padding, the first step's small caches)."""
    cuda = r["device"] != "cpu"
    opt, expected = r["optimizer_mib_per_rank"], r["optimizer_mib_expected_per_rank"]
    return {"step_ran": r["last_step_ok"] and r["grad_norm"] is not None and r["grad_norm"] == r["grad_norm"] < 1e30,
            "nccl": r["backend"] == "nccl" if cuda else None,
            "te_spec_where_installed": (r["spec"].startswith("transformer_engine") or not has_te() or r["local_spec"])
            if cuda else None,
            "optimizer_memory": all(abs(m - e) <= 0.1 * e + 64 for m, e in zip(opt, expected)) if opt else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dist-opt", action="store_true", help="megatron-core's DistributedOptimizer (CUDA only)")
    ap.add_argument("--local-spec", action="store_true", help="the local spec even where transformer_engine imports")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--batch", type=int, default=8, help="global sequences per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch.distributed as dist

    from learner.backends.megatron import parallel

    r = run(args)
    r["checks"] = checks(r)
    if dist.get_rank() == 0:
        mfu = f"{100 * r['mfu']:.2f}%" if r["mfu"] is not None else "n/a (no peak for CPU)"
        print(f"{r['spec']}, {r['backend']}, {r['ranks']}x EP{r['ep']} TP{r['tp']} "
              f"{'DistributedOptimizer' if r['dist_opt'] else 'replicated optimizer'}: step "
              f"{r['step_s_median'] * 1e3:.1f} ms, {r['tokens_per_s']:.0f} tok/s, MFU {mfu}, peak MiB per rank "
              f"{[round(x) for x in r['peak_mib_per_rank']]}; optimizer MiB per rank {r['optimizer_mib_per_rank']} "
              f"(expected {[round(x, 1) for x in r['optimizer_mib_expected_per_rank']]})", flush=True)
        bad = [k for k, v in r["checks"].items() if v is False]
        print("megatron_gpu_paths: " + (f"FAIL {bad}" if bad else "PASS") + f" {r['checks']}", flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(r, indent=2))
    parallel.shutdown()
    return 1 if any(v is False for v in r["checks"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speed of the warm start's training step before and after a change of its loss (`learner/models/packed.py`).

The step is `learner.pretrain`'s own: a batch of the default scenario's demonstrations (`batches`), then
`optimizer_step` (packed forward and backward, clip, fused AdamW). "Before" is packed.py at a git revision
(`--before`), swapped into `learner.pretrain` for its steps; "after" is the working tree's. Two models from
the same seed train side by side on the same batches, each step timed for both in alternating order (the first
2 dropped): per step, CPU time on 1 thread (the figure to compare on a shared machine: other work on the cores
inflates wall time, much less CPU time) and wall time on 2 threads; the ratio is the median of the per-step
ratios. Op counts from the profiler.
Prints and saves docs/results/warmstart_step.json.

    .venv/bin/python bench/warmstart_step.py [--before REV] [--steps 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

if __package__ in (None, ""):  # `python bench/warmstart_step.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import learner.models.packed as packed_after  # noqa: E402
import learner.pretrain as lp  # noqa: E402
from bench.common import git, git_commit  # noqa: E402
from learner.models import CharTokenizer, build_policy  # noqa: E402
from simulator.scenario import load_scenario  # noqa: E402

BASE = "5de9ad1"  # the branch's start: packed.py before the speed-ups
WARMUP = 2  # steps dropped at the start of each run
OPS = ("aten::mm", "aten::mul", "aten::cat", "aten::fill_", "aten::copy_", "aten::pow", "aten::index_select",
       "aten::scatter_add_", "aten::add_", "aten::silu_backward")


def packed_at(rev: str) -> types.ModuleType:
    module = types.ModuleType(f"packed_{rev}")
    exec(compile(git("show", f"{rev}:learner/models/packed.py"), f"{rev}:packed.py", "exec"), module.__dict__)
    return module


def use(module: types.ModuleType) -> None:
    lp.PackedBatch, lp.packed_loss = module.PackedBatch, module.packed_loss


def paired(before: types.ModuleType, after: types.ModuleType, steps: int, threads: int, clock) -> dict:
    """Two models from the same seed trained side by side on the same batches, each step timed for both (in
    alternating order) by `clock`: a change in the load of a shared machine hits both of a pair alike."""
    torch.set_num_threads(threads)
    cfg, tok = lp.PretrainConfig(), CharTokenizer()
    data = lp.batches(load_scenario(cfg.scenario), cfg, tok)
    runs = {}
    for name in ("before", "after"):
        torch.manual_seed(cfg.seed)
        model = build_policy(cfg.model, tok.vocab_size, seed=cfg.seed).train()
        runs[name] = (before if name == "before" else after, model, lp.make_optimizer(model, cfg), [], [])
    for step in range(steps):
        items = next(data)
        for name in ("before", "after") if step % 2 == 0 else ("after", "before"):
            module, model, opt, ms, losses = runs[name]
            use(module)
            t = clock()
            losses.append(lp.optimizer_step(model, opt, tok, items, step, cfg))
            ms.append((clock() - t) * 1000)
    ms = {k: v[3][WARMUP:] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in ms.items()}
    ratios = [a / b for a, b in zip(ms["after"], ms["before"])]
    losses = {k: v[4] for k, v in runs.items()}  # the same training: equal to float32 rounding
    return {"threads": threads, "clock": clock.__name__, "steps": len(ratios), "before_ms": round(med["before"], 1),
            "after_ms": round(med["after"], 1), "ratio": round(statistics.median(ratios), 3),
            "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios, n=4)],
            "projected_warm_start_s": {k: round(cfg.steps * v / 1000, 1) for k, v in med.items()},
            "warm_start_steps": cfg.steps,
            "last_loss": {k: v[-1] for k, v in losses.items()},
            "max_loss_difference": max(abs(a - b) for a, b in zip(losses["before"], losses["after"]))}


def op_counts(module: types.ModuleType, steps: int = 3) -> dict:
    """Per step, at 1 thread: all aten calls, and calls and self CPU ms of the ops that dominate the profile."""
    use(module)
    torch.set_num_threads(1)
    cfg, tok = lp.PretrainConfig(), CharTokenizer()
    model = build_policy(cfg.model, tok.vocab_size, seed=cfg.seed).train()
    opt, data = lp.make_optimizer(model, cfg), lp.batches(load_scenario(cfg.scenario), cfg, tok)
    for step in range(WARMUP):
        lp.optimizer_step(model, opt, tok, next(data), step, cfg)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(WARMUP, WARMUP + steps):
            lp.optimizer_step(model, opt, tok, next(data), step, cfg)
    events = prof.key_averages()
    out = {"aten_calls": round(sum(e.count for e in events if e.key.startswith("aten::")) / steps)}
    for e in events:
        if e.key in OPS:
            out[e.key] = {"calls": round(e.count / steps), "self_ms": round(e.self_cpu_time_total / 1000 / steps, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=BASE, help=f"git revision of the 'before' packed.py (default {BASE})")
    p.add_argument("--steps", type=int, default=40, help="paired steps per thread count (the first 2 dropped)")
    p.add_argument("--out", default="docs/results/warmstart_step.json")
    args = p.parse_args(argv)
    before, threads = packed_at(args.before), torch.get_num_threads()
    t, load = time.perf_counter(), os.getloadavg()
    try:
        result = {
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch": torch.__version__},
            "before": git("rev-parse", "--short", args.before),
            "after": git_commit(),
            "warmup_steps": WARMUP,
            "cpu_1_thread": paired(before, packed_after, args.steps, 1, time.process_time),
            "wall_2_threads": paired(before, packed_after, args.steps, 2, time.perf_counter),
            "ops_per_step": {"before": op_counts(before), "after": op_counts(packed_after)},
        }
    finally:
        use(packed_after)
        torch.set_num_threads(threads)
    result["bench_seconds"] = round(time.perf_counter() - t, 1)
    result["load_average_1min"] = {"start": load[0], "end": os.getloadavg()[0]}  # other work on the cores
    for key in ("cpu_1_thread", "wall_2_threads"):
        r = result[key]
        print(f"{key}: before {r['before_ms']} ms/step, after {r['after_ms']} ms/step, ratio {r['ratio']} "
              f"(quartiles {r['ratio_quartiles']}); {r['warm_start_steps']} steps: {r['projected_warm_start_s']} s; "
              f"largest loss difference over {args.steps} steps {r['max_loss_difference']:.1e}")
    ops = result["ops_per_step"]
    print(f"aten calls per step: before {ops['before']['aten_calls']}, after {ops['after']['aten_calls']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

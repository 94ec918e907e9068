"""Behaviour log-probs of an engine against the learner's forward pass on the same weights.

The trainer's policy ratio is r_t = exp(logp_learner - logp_engine): any numeric mismatch between the
inference engine and `learner.models.token_logprobs` (fp32, CPU) shows up as off-policyness even at
staleness 0, and the clip band then masks tokens for no algorithmic reason. This measures it:
mean / max |logp_engine - logp_learner|, the mean |r - 1| and mean r - 1, the k3 KL estimate
mean(r - 1 - log r), and the share of tokens outside the clip band [1 - eps_low, 1 + eps_high].
Generation at temperature 1, so the sampled distribution is the model's own. Saves
runs/bench/logprob_mismatch_<engine>.json.

    .venv/bin/python bench/logprob_mismatch.py --engine torch
    .venv/bin/python bench/logprob_mismatch.py --engine hf --model runs/<run>/policy
    python bench/logprob_mismatch.py --engine vllm --vllm "dtype=bfloat16"   # GPU env with the vllm extra
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from learner.engines import make_engine
from learner.models import CharTokenizer, build_policy, load_policy, token_logprobs


def prompts_for(batch: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of 8-24 tokens: <bos> then characters of the alphabet."""
    g = torch.Generator().manual_seed(seed)
    tok = CharTokenizer()
    lengths = torch.randint(8, 25, (batch,), generator=g).tolist()
    return [[tok.bos_id] + torch.randint(8, tok.vocab_size, (n - 1,), generator=g).tolist() for n in lengths]


def learner_logprobs(model, prompts: list[list[int]], gens: list[list[int]], chunk: int = 16) -> list[list[float]]:
    """The learner's log-probs of each generated token (right-padded batches of `chunk` rows)."""
    out = []
    for s in range(0, len(prompts), chunk):
        rows = [p + g for p, g in zip(prompts[s:s + chunk], gens[s:s + chunk])]
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        with torch.no_grad():
            lp = token_logprobs(model, ids, mask)
        for i, (p, g) in enumerate(zip(prompts[s:s + chunk], gens[s:s + chunk])):
            out.append(lp[i, len(p):len(p) + len(g)].tolist())
    return out


def mismatch(engine_lp: list[float], learner_lp: list[float], eps_low: float, eps_high: float) -> dict[str, float]:
    e, learner = torch.tensor(engine_lp, dtype=torch.float64), torch.tensor(learner_lp, dtype=torch.float64)
    d = e - learner
    log_r = learner - e
    r = log_r.exp()
    outside = (r < 1 - eps_low) | (r > 1 + eps_high)
    return {
        "tokens": len(engine_lp),
        "mean_abs_diff": d.abs().mean().item(), "max_abs_diff": d.abs().max().item(), "mean_diff": d.mean().item(),
        "mean_abs_ratio_dev": (r - 1).abs().mean().item(), "mean_ratio_minus_1": (r - 1).mean().item(),
        "max_abs_ratio_dev": (r - 1).abs().max().item(), "k3_kl": (r - 1 - log_r).mean().item(),
        "frac_outside_clip": outside.double().mean().item(),
    }


def build_engine(name: str, model, tok: CharTokenizer, vllm_set: str):
    if name != "vllm":
        return make_engine(name, model, tok)
    from learner.engines.vllm import VLLMEngine, settings_from_env

    return VLLMEngine.from_policy(model, tok, settings_from_env({"SAO_VLLM": vllm_set}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="torch", choices=["torch", "hf", "vllm"])
    ap.add_argument("--model", default="", help="policy directory; default: a fresh policy (seed 0)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=48, help="max_new_tokens")
    ap.add_argument("--eps-low", type=float, default=0.2)
    ap.add_argument("--eps-high", type=float, default=0.28)
    ap.add_argument("--vllm", default="", help="vLLM settings, 'key=value ...' (see VLLMSettings), e.g. dtype=bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = CharTokenizer()
    model = load_policy(args.model) if args.model else build_policy(seed=0)
    engine = build_engine(args.engine, model, tok, args.vllm)
    prompts = prompts_for(args.batch)
    t0 = time.perf_counter()
    gens = engine.generate(prompts, args.new, temperature=1.0, seed=0)
    gen_s = time.perf_counter() - t0
    ref = learner_logprobs(model, prompts, [g.token_ids for g in gens])
    eng_lp = [x for g in gens for x in g.logprobs]
    stats = mismatch(eng_lp, [x for r in ref for x in r], args.eps_low, args.eps_high)
    result = {"engine": args.engine, "model": args.model or "fresh seed 0", "batch": args.batch, "max_new": args.new,
              "eps_low": args.eps_low, "eps_high": args.eps_high, "vllm": args.vllm if args.engine == "vllm" else "",
              "learner": "learner.models.token_logprobs, fp32 CPU", "generate_s": round(gen_s, 3),
              "mean_logp": sum(eng_lp) / max(len(eng_lp), 1), **stats}
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    print(f"engine {args.engine}: {stats['tokens']} tokens, |dlogp| mean {stats['mean_abs_diff']:.3g} "
          f"max {stats['max_abs_diff']:.3g}; |r-1| mean {stats['mean_abs_ratio_dev']:.3g} "
          f"(r-1 mean {stats['mean_ratio_minus_1']:+.3g}), k3 KL {stats['k3_kl']:.3g}, "
          f"outside clip [{1 - args.eps_low:g}, {1 + args.eps_high:g}]: {100 * stats['frac_outside_clip']:.2f}%")
    out = Path(args.out or f"runs/bench/logprob_mismatch_{args.engine}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

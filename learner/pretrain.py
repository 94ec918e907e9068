"""`sao pretrain`: supervised warm start of the tiny policy on a scenario's warm-start mixture.

Demonstrations (`simulator.warmstart`) are trained with token cross-entropy on what the agent
generates (tool observations are the environment's: masked), AdamW lr 2e-3, batch 128 and a
cosine schedule with warm-up (CALIBRATION.md: a constant lr stalled at 0.885 greedy accuracy).
The result is an HF directory cached under `runs/cache/warmstart-<hash>` and reused when the
config and the scenario file are unchanged.

    sao pretrain [--scenario default] [--out DIR] [--force] [steps=1500 lr=2e-3 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from learner.models import CharTokenizer, ModelConfig, build_policy, save_policy
from simulator.env import Step, make_env
from simulator.latency import LatencyConfig
from simulator.scenario import Scenario, load_scenario, resolve_path
from simulator.warmstart import demos, segments
from streamer.config import ConfigError, load_config, to_dict
from streamer.schema import Task

NO_LATENCY = LatencyConfig(mean_s=0.0, sleep=False)


@dataclass
class PretrainConfig:
    scenario: str = "default"  # scenario file or name: its warm_start section is the data
    steps: int = 800
    batch_size: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1  # on a shared 2-core machine one thread wastes less in OpenMP spin-waits
    eval_every: int = 250  # greedy reward on held-out phase-0 tasks every this many steps (0: never)
    eval_tasks: int = 256
    cache_dir: str = "runs/cache"
    micro_batches: int = 8  # the batch is sorted by length and split, so padding costs little compute
    model: ModelConfig = field(default_factory=ModelConfig)


def config_hash(cfg: PretrainConfig, scn_text: str) -> str:
    keep = {k: v for k, v in to_dict(cfg).items() if k not in ("threads", "eval_every", "eval_tasks", "cache_dir")}
    blob = json.dumps({"cfg": keep, "scenario": scn_text, "format": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def encode_demo(tok: CharTokenizer, prompt: str, text: str) -> tuple[list[int], list[int]]:
    """Token ids of <bos> prompt completion <eos>, and a mask of the tokens the agent generates."""
    ids = tok.encode(prompt, bos=True)
    mask = [0] * len(ids)
    for part, generated in segments(text):
        enc = tok.encode(part)
        ids += enc
        mask += [int(generated)] * len(enc)
    return ids + [tok.eos_id], mask + [1]


def make_batch(tok: CharTokenizer, items: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    T = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), T), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(len(items), T, dtype=torch.long)
    attn = torch.zeros(len(items), T, dtype=torch.long)
    for i, (x, m) in enumerate(items):
        ids[i, :len(x)], mask[i, :len(m)], attn[i, :len(x)] = torch.tensor(x), torch.tensor(m), 1
    return ids, mask, attn


def lm_loss(model, ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [B, T-1, V] predicts ids[:, 1:]
    target, m = ids[:, 1:], mask[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
    return (nll * m.reshape(-1)).sum() / m.sum().clamp(min=1)


def train_step(model, tok: CharTokenizer, items: list[tuple[list[int], list[int]]], n_micro: int) -> float:
    """Gradient of the token-mean loss over the whole batch, computed in length-sorted micro-batches."""
    items = sorted(items, key=lambda x: len(x[0]))
    total = sum(sum(m[1:]) for _, m in items)
    size = math.ceil(len(items) / n_micro)
    loss_sum = 0.0
    for i in range(0, len(items), size):
        ids, mask, attn = make_batch(tok, items[i:i + size])
        n = mask[:, 1:].sum().item()
        loss = lm_loss(model, ids, mask, attn) * (n / total)  # token-mean over the full batch
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def cosine_lr(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def eval_tasks(scn: Scenario, concepts: dict[str, str], n: int, seed: int) -> list[Task]:
    """Untagged tasks (as drifted streams show them) of the given concepts, from a held-out seed."""
    stream = demos(scn, seed=10_000 + seed, tagged=False, concepts=concepts)
    return [next(stream).task for _ in range(n)]


def rollout(engine, tok: CharTokenizer, tasks: list[Task], temperature: float, seed: int = 0,
            max_new_tokens: int = 24, max_rounds: int = 5) -> list[Step]:
    """Batched episodes through each task's environment (tool calls answered in between)."""
    envs = [make_env(t, NO_LATENCY) for t in tasks]
    ctx = [tok.encode(e.prompt(), bos=True) for e in envs]
    results: list[Step | None] = [None] * len(tasks)
    active = list(range(len(tasks)))
    for r in range(max_rounds):
        if not active:
            break
        gens = engine.generate([ctx[i] for i in active], max_new_tokens, temperature=temperature,
                               stop=["</call>"], seed=seed * 1000 + r)
        still = []
        for i, g in zip(active, gens):
            step = envs[i].step(tok.decode(g.token_ids))
            if step.done:
                results[i] = step
            else:
                ctx[i] = ctx[i] + g.token_ids + tok.encode(step.observation)
                still.append(i)
        active = still
    for i in active:
        results[i] = envs[i].step("")
    return results


def evaluate(model, scn: Scenario, concepts: dict[str, str], n: int, temperature: float = 0.0,
             seed: int = 0) -> dict[str, float]:
    from learner.engines import make_engine

    tok = CharTokenizer()
    tasks = eval_tasks(scn, concepts, n, seed)
    steps = rollout(make_engine("torch", model, tok), tok, tasks, temperature, seed)
    out = {"reward": sum(s.reward for s in steps) / n, "success": sum(s.success for s in steps) / n,
           "full_reward": sum(s.reward >= 1.0 for s in steps) / n}  # solved with no tool error
    for fam in sorted({t.family for t in tasks}):
        idx = [i for i, t in enumerate(tasks) if t.family == fam]
        out[f"reward/{fam}"] = sum(steps[i].reward for i in idx) / len(idx)
    return out


def train(cfg: PretrainConfig, scn: Scenario, log=print) -> tuple[torch.nn.Module, list[dict]]:
    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    model = build_policy(cfg.model, tok.vocab_size, seed=cfg.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    stream = demos(scn, seed=cfg.seed)
    phase0 = scn.phases[0].concepts
    history, t0, c0 = [], time.perf_counter(), time.process_time()
    for step in range(cfg.steps):
        items = [encode_demo(tok, d.task.prompt, d.text) for d in (next(stream) for _ in range(cfg.batch_size))]
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, tok, items, cfg.micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        last = step == cfg.steps - 1
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
            model.eval()
            ev = evaluate(model, scn, {f: c for f, c in phase0.items() if isinstance(c, str)}, cfg.eval_tasks)
            model.train()
            row = {"step": step + 1, "seconds": round(time.perf_counter() - t0, 1),
                   "cpu_seconds": round(time.process_time() - c0, 1), "loss": round(loss, 4), **ev}
            history.append(row)
            log(json.dumps(row))
    return model.eval(), history


def pretrain(cfg: PretrainConfig, out: str | Path | None = None, force: bool = False, log=print) -> Path:
    """Train (or reuse the cached result) and return the policy directory."""
    torch.set_num_threads(cfg.threads)
    path_scn = resolve_path(cfg.scenario)
    scn = load_scenario(path_scn)
    digest = config_hash(cfg, path_scn.read_text())
    out = Path(out) if out else Path(cfg.cache_dir) / f"warmstart-{digest}"
    meta = out / "pretrain.json"
    if not force and meta.is_file() and json.loads(meta.read_text()).get("hash") == digest:
        log(f"pretrain: reusing {out}")
        return out
    t = time.perf_counter()
    model, history = train(cfg, scn, log)
    save_policy(model, out, CharTokenizer())
    meta.write_text(json.dumps({"hash": digest, "config": to_dict(cfg), "seconds": round(time.perf_counter() - t, 1),
                                "history": history}, indent=1))
    log(f"pretrain: saved {out}")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sao pretrain", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", help="scenario file or name (default: default)")
    p.add_argument("--out", help="policy directory (default: <cache_dir>/warmstart-<hash>)")
    p.add_argument("--force", action="store_true", help="train even if a cached result exists")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="PretrainConfig fields, e.g. steps=800")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + ([f"scenario={args.scenario}"] if args.scenario else [])
    try:
        cfg = load_config(PretrainConfig, None, overrides)
        out = pretrain(cfg, args.out, args.force)
    except (ConfigError, ValueError) as e:
        print(f"sao pretrain: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0

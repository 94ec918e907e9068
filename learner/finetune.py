"""`sao finetune`: supervised warm start of any HF causal LM on the demonstrations a recorded stream carries.

A production row may carry a `demonstration`: an answer a person or the production model wrote for it
(`simulator.records`). The demonstrations among the stream's first `rows` rows (0: all of them) are
encoded as the agents will see them (the prompt through the model's chat template, then the answer and
end-of-sequence; only the answer is trained on) and trained with token cross-entropy, AdamW and a
cosine schedule. The result is an HF directory (model and tokenizer) cached under
`runs/cache/finetune-<hash>` and reused while the model, the demonstrations and the config are unchanged.
`sao up --model DIR --stream FILE --set finetune.rows=N` runs it before the RL run: for a pretrained
model no warm start is needed, this one is for a model that has not yet seen the stream's task format.

    sao finetune MODEL_DIR STREAM [--out DIR] [--set steps=200 --set rows=256 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from learner.models.packed import lm_loss, make_batch
from learner.models.policy import load_policy, save_policy
from learner.models.tokenizer import Tokenizer, load_tokenizer
from learner.pretrain import Progress, Threads, cosine_lr, fmt_duration
from simulator.replay import add_plugin_args, enable_plugins
from streamer.wire.config import ConfigError, add_config_args, load_config


@dataclass
class FinetuneConfig:
    rows: int = 0  # demonstrations among the stream's first this many rows (0: none, no fine-tuning)
    steps: int = 300
    batch_size: int = 32
    lr: float = 1e-3  # a toy model from scratch; use ~1e-5 for a pretrained model
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 0  # 0: min(cores, 4), or 1 while a probe finds other work on the cores (`learner.pretrain`)
    cache_dir: str = "runs/cache"


def read_demonstrations(stream: str | Path, rows: int, model_dir: str | Path | None = None, log=print,
                        ) -> list[tuple[str, list[dict] | None, str]]:
    """(prompt, chat messages or None, demonstration) of the production rows among the first `rows` that carry
    one. Rows that are not valid tasks for the model in `model_dir` are left out and counted in the log (the replay
    sets them aside too)."""
    from simulator.records import RowError, message_from_row, prompt_rule
    from simulator.replay import read_rows, row_dict

    rule, out, bad = prompt_rule(model_dir, load_tokenizer), [], []
    for n, raw, fmt in read_rows(Path(stream)):
        if n > rows:
            break
        try:
            row = row_dict(raw, fmt)
            demo = row.get("demonstration")
            task = message_from_row(row, tabular=fmt != "jsonl", rule=rule) if demo else None
        except RowError as e:
            bad.append(f"row {n}: {e}")
            continue
        if task is not None:
            out.append((task.prompt, task.spec.get("messages"), demo))
    if bad:
        log(f"finetune: left out {len(bad)} invalid row(s) of the first {rows}, first {bad[0]}")
    return out


def encode(tok: Tokenizer, prompt: str, messages: list[dict] | None, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the prompt as the agents send it, the answer and end-of-sequence; a mask of the answer's."""
    p, a = tok.encode_prompt(prompt, messages), tok.encode(answer) + [tok.eos_id]
    return p + a, [0] * len(p) + [1] * len(a)


def cache_key(model_dir: Path, demos: list, cfg: FinetuneConfig) -> str:
    weights = sorted(model_dir.glob("*.safetensors"))
    stamp = [(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights]
    keep = {k: v for k, v in asdict(cfg).items() if k not in ("cache_dir", "threads")}
    blob = json.dumps({"model": str(model_dir.resolve()), "weights": stamp, "demos": demos, "cfg": keep})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def train(model, tok: Tokenizer, items: list[tuple[list[int], list[int]]], cfg: FinetuneConfig,
          progress: Progress) -> list[float]:
    rng, threads = random.Random(cfg.seed), Threads(cfg.threads)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    losses = []
    model.train()
    for step in range(cfg.steps):
        threads.check(step)
        t = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg)
        opt.zero_grad(set_to_none=True)
        batch = rng.sample(items, min(cfg.batch_size, len(items)))
        loss = lm_loss(model, *make_batch(tok, batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        threads.done(time.perf_counter() - t, sum(len(ids) for ids, _ in batch))
        losses.append(loss.item())
        progress.update(step + 1, losses[-1])
    return losses


def finetune(model_dir: str | Path, stream: str | Path, cfg: FinetuneConfig, out: str | Path | None = None,
             log=print) -> Path:
    """Fine-tune (or reuse the cached result) and return the model directory; `model_dir` itself if the stream's
    first `cfg.rows` rows carry no demonstration."""
    model_dir = Path(model_dir)
    demos = read_demonstrations(stream, cfg.rows, model_dir, log) if cfg.rows > 0 else []
    if not demos:
        log(f"finetune: no demonstrations in the first {cfg.rows} rows of {stream}: {model_dir} as it is")
        return model_dir
    out = Path(out) if out else Path(cfg.cache_dir) / f"finetune-{cache_key(model_dir, demos, cfg)}"
    if (out / "finetune.json").is_file():
        log(f"finetune: reusing {out}")
        return out
    torch.manual_seed(cfg.seed)
    tok, model = load_tokenizer(model_dir), load_policy(model_dir)
    items = [encode(tok, p, m, d) for p, m, d in demos]
    log(f"finetune: {cfg.steps} steps of {cfg.batch_size} on {len(items)} demonstrations of {stream}")
    t = time.perf_counter()
    losses = train(model, tok, items, cfg, Progress(cfg.steps, label="finetune"))
    save_policy(model.eval(), out, tok)
    seconds = round(time.perf_counter() - t, 1)
    (out / "finetune.json").write_text(json.dumps({"from": str(model_dir), "stream": str(stream), "config": asdict(cfg),
                                                   "demonstrations": len(items), "seconds": seconds,
                                                   "loss_first": losses[0], "loss_last": losses[-1]}, indent=1))
    log(f"finetune: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {fmt_duration(seconds)}; saved {out}")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sao finetune", description=__doc__.splitlines()[0])
    p.add_argument("model", help="HF model directory (any causal LM with its tokenizer)")
    p.add_argument("stream", help="recorded stream whose rows carry demonstrations")
    p.add_argument("--out", help="output directory (default: <cache_dir>/finetune-<hash>)")
    add_plugin_args(p)
    add_config_args(p, "FinetuneConfig", "rows=256")
    args = p.parse_args(argv)
    try:
        enable_plugins(args.verifier, args.tool_env)
        cfg = load_config(FinetuneConfig, args.config, args.overrides, section="finetune")
        if cfg.rows <= 0:
            raise ConfigError("finetune.rows: give the number of stream rows to take demonstrations from (> 0)")
        print(finetune(args.model, args.stream, cfg, args.out))
    except (ConfigError, ValueError, OSError) as e:  # a PluginError is a ValueError
        print(f"sao finetune: {e}", file=sys.stderr)
        return 2
    return 0

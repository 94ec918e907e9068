"""`sao pretrain`: supervised warm start of the tiny policy on a scenario's warm-start mixture.

Demonstrations (`simulator.warmstart`) are trained with token cross-entropy on what the agent
generates (tool observations are the environment's: masked), AdamW lr 2.2e-3, batch 128 and a
cosine schedule with warm-up (CALIBRATION.md: a constant lr stalled at 0.885 greedy accuracy).
The result is an HF directory cached under `runs/cache/warmstart-<hash>` and reused when the
config and the scenario file are unchanged.

Speed (the first `sao up` waits for this): the loss is computed by `learner.models.packed.packed_loss`,
the same forward as the HF model's on the same weights (tested against it) but over the batch's tokens
packed without padding. Threads: `threads=0` (default) uses
min(cores, 4) unless a short probe, repeated every 30 s, finds several threads slower than one
(another busy process on the cores makes OpenMP wait for time slices: measured 40x slower). The
reduction order follows the thread count, so only a pinned `threads=N` rebuilds the same bits (a
benchmark's warm start pins it; it is then part of the cache key), and only on the same kind of CPU: the
kernels torch and MKL pick for the CPU (`kernels()`, recorded in pretrain.json) change the bits too. Measured
(4d013d6:docs/bench/suite_main/v1.4/warm_start_builds.json): drift_v1's warm start, threads=1, built with one digest
on the earlier sessions' machines and with another on an AMD EPYC (AVX512); MKL_CBWR or ATEN_CPU_CAPABILITY
settings there gave three more, none the earlier one.
The held-out evaluation (greedy, the agents' env loop) runs once at the end (`eval_every=N` adds one
every N steps, `eval_tasks=0` none); a progress bar shows step, loss, speed and ETA.

    sao pretrain [--scenario default] [--out DIR] [--force] [--config FILE] [--set steps=760 --set lr=2.2e-3 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
import yaml

from learner.models import CharTokenizer, ModelConfig, build_policy, save_policy
from learner.models.packed import PackedBatch, packed_loss
from simulator.latency import LatencyConfig
from simulator.scenario import Scenario, load_scenario, resolve_path
from simulator.warmstart import demos, held_out_tasks, segments
from streamer.wire.config import ConfigError, add_config_args, load_config, to_dict
from streamer.wire.schema import Trajectory
from streamer.wire.settings import AgentSettings

NO_LATENCY = LatencyConfig(mean_s=0.0, sleep=False)  # the held-out evaluation's tool calls answer at once
EVAL_NEW_TOKENS, EVAL_TURNS = 24, 5  # per turn, and turns per episode, of the held-out evaluation
# the agents' episode loop, `streamer.agent.rollouts.run_tasks(engine, tok, tasks, settings, label, latency)`:
# one list of trajectories per task (the learner does not import the agent: its caller passes it)
RunTasks = Callable[..., list[list[Trajectory]]]


@dataclass
class PretrainConfig:
    scenario: str = "default"  # scenario file or name: its warm_start section is the data
    steps: int = 760
    batch_size: int = 128
    lr: float = 2.2e-3
    min_lr_ratio: float = 0.05  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 40
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 0  # 0: min(cores, 4), or 1 while a probe finds other work on the cores (see module doc)
    eval_every: int = 0  # greedy reward on held-out phase-0 tasks at the end, and every this many steps if > 0
    eval_tasks: int = 256  # 0: no evaluation
    cache_dir: str = "runs/cache"
    micro_batches: int = 8  # the batch is sorted by length and split into this many attention groups (least padding)
    model: ModelConfig = field(default_factory=ModelConfig)


def warm_start_inputs(scn_text: str) -> dict:
    """The parts of a scenario file the warm start reads: its warm_start section, the family options, and phase 0's
    families and concepts (the fallback mixture and the held-out evaluation). Later phases are not among them, so
    re-timing the drifts of a scenario keeps its cached warm start."""
    raw = yaml.safe_load(scn_text) or {}
    first = (raw.get("phases") or [{}])[0] or {}
    return {"warm_start": raw.get("warm_start"), "options": raw.get("options"),
            "phase0": {k: first.get(k) for k in ("families", "concepts")}}


def config_hash(cfg: PretrainConfig, scn_text: str) -> str:
    # the scenario counts by its contents; threads only when pinned: a fixed thread count fixes the reduction order,
    # so a build with it has the same bits on every run (auto threads follow the load, and the bits with them)
    skip = ("eval_every", "eval_tasks", "cache_dir", "scenario") + (("threads",) if cfg.threads <= 0 else ())
    keep = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}  # every field, set or default
    blob = json.dumps({"cfg": keep, "scenario": warm_start_inputs(scn_text), "format": 2}, sort_keys=True)
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


def train_step(model, tok: CharTokenizer, items: list[tuple[list[int], list[int]]], n_micro: int) -> float:
    """Gradient of the token-mean loss over the whole batch (one packed forward and backward)."""
    loss = packed_loss(model, PackedBatch(items, n_micro))
    loss.backward()
    return loss.item()


def make_optimizer(model, cfg: PretrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95),
                             fused=True)  # one kernel over all tensors: same update, 3x less time


def batches(scn: Scenario, cfg: PretrainConfig, tok: CharTokenizer) -> Iterator[list[tuple[list[int], list[int]]]]:
    """The training batches: `cfg.batch_size` encoded demonstrations each, from the scenario's warm-start stream."""
    stream = demos(scn, seed=cfg.seed)
    while True:
        yield [encode_demo(tok, d.task.prompt, d.text) for d in (next(stream) for _ in range(cfg.batch_size))]


def optimizer_step(model, opt: torch.optim.Optimizer, tok: CharTokenizer, items: list[tuple[list[int], list[int]]],
                   step: int, cfg: PretrainConfig) -> float:
    """One training step on a batch: the scheduled lr, the batch's gradient, clipped, and AdamW. Returns the loss."""
    for group in opt.param_groups:
        group["lr"] = cosine_lr(step, cfg)
    opt.zero_grad(set_to_none=True)
    loss = train_step(model, tok, items, cfg.micro_batches)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss


def cosine_lr(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def evaluate(model, scn: Scenario, concepts: dict[str, str], n: int, temperature: float = 0.0,
             seed: int = 0, *, run_tasks: RunTasks) -> dict[str, float]:
    """Mean reward, success and full-reward share on `n` held-out tasks (`simulator.warmstart.held_out_tasks`),
    one episode each through the agents' own env loop (`run_tasks`: the caller passes
    `streamer.agent.rollouts.run_tasks`; the learner does not import the agent), all in flight together, tool
    calls answered without latency; and the reward per family."""
    from learner.engines import make_engine

    tok = CharTokenizer()
    tasks = held_out_tasks(scn, concepts, n, seed)
    s = AgentSettings(temperature=temperature, group_size=1, concurrency=max(1, n), max_new_tokens=EVAL_NEW_TOKENS,
                      max_turns=EVAL_TURNS, seed=seed)
    trajs = [t[0] for t in run_tasks(make_engine("torch", model, tok), tok, tasks, s, "pretrain", NO_LATENCY)]
    out = {"reward": sum(t.reward for t in trajs) / n, "success": sum(t.success for t in trajs) / n,
           "full_reward": sum(t.reward >= 1.0 for t in trajs) / n}  # solved with no tool error
    for fam in sorted({t.family for t in tasks}):
        idx = [i for i, t in enumerate(tasks) if t.family == fam]
        out[f"reward/{fam}"] = sum(trajs[i].reward for i in idx) / len(idx)
    return out


def _needs_run_tasks(cfg: PretrainConfig, run_tasks: RunTasks | None) -> None:
    if cfg.eval_tasks > 0 and run_tasks is None:
        raise ValueError("the held-out evaluation (eval_tasks > 0) runs the agents' episode loop: pass run_tasks "
                         "(streamer.agent.rollouts.run_tasks; sao pretrain and sao up do), or set eval_tasks=0")


def fmt_duration(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """`warm start  312/800 [#####.....] 39% loss 0.184 2.1 steps/s ETA 3m52s`: redrawn in place (\\r) on a
    terminal, else a plain line every `every` seconds (and at the first and last step) for logs."""

    def __init__(self, total: int, stream=None, every: float = 10.0, label: str = "warm start", width: int = 20):
        self.total, self.every, self.label, self.width = total, every, label, width
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.last_draw = -math.inf
        self.loss: float | None = None
        self.reward: float | None = None
        self.shown = 0  # length of the line drawn in place

    def line(self, step: int) -> str:
        frac = step / max(1, self.total)
        bar = "#" * round(frac * self.width) + "." * (self.width - round(frac * self.width))
        out = f"{self.label}  {step:>{len(str(self.total))}}/{self.total} [{bar}] {frac:4.0%}"
        if self.loss is not None:
            out += f" loss {self.loss:.3f}"
        if self.reward is not None:
            out += f" reward {self.reward:.3f}"
        elapsed = time.perf_counter() - self.t0
        if step:
            rate = step / max(elapsed, 1e-9)
            out += f" {rate:.1f} steps/s ETA {fmt_duration((self.total - step) / rate)}"
        return out

    def update(self, step: int, loss: float | None = None, reward: float | None = None) -> None:
        if loss is not None:  # smoothed: one batch's loss is noisy
            self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
        if reward is not None:
            self.reward = reward
        now = time.perf_counter()
        edge = step in (1, self.total) or reward is not None
        if self.tty:
            if edge or now - self.last_draw >= 0.2:
                text = self.line(step)
                self.stream.write("\r" + text + " " * max(0, self.shown - len(text)))
                self.shown = len(text)
                if step == self.total:
                    self.stream.write("\n")
                    self.shown = 0
                self.stream.flush()
                self.last_draw = now
        elif edge or now - self.last_draw >= self.every:
            self.stream.write(self.line(step) + "\n")
            self.stream.flush()
            self.last_draw = now


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _probe(threads: int, reps: int = 12) -> float:
    """Seconds for a few matmuls shaped like a training step's, on `threads` threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(576, 128, generator=gen), torch.randn(512, 128, generator=gen)
    for _ in range(3):  # wakes the thread pool
        F.silu(F.linear(x, w))
    t = time.perf_counter()
    for _ in range(reps):
        F.silu(F.linear(x, w))
    return time.perf_counter() - t


def kernels() -> dict[str, object]:
    """What besides the code and the thread count fixes a build's bits: the CPU, the vector kernels torch
    dispatches to on it, the BLAS, and the environment settings that override either."""
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), None)
    blas = re.search(r"Math Kernel Library Version [^\n]*?(?= for |$)", torch.__config__.show())
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "blas": blas.group(0) if blas else None,
            **{k: os.environ[k] for k in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return []


class Threads:
    """`threads=0`: min(cores, 4), but 1 whenever a probe finds one thread faster. With another busy process on the
    cores each OpenMP region waits for a time slice (measured: steps 40x slower on 2 threads than on 1). The probe
    runs every `every` seconds, and at once after a step 3x slower per token than the best so far."""

    def __init__(self, threads: int, every: float = 30.0) -> None:
        self.auto = threads <= 0
        self.max = min(available_cores(), 4) if self.auto else threads
        self.every, self.checked = every, -math.inf
        self.now = self.max
        self.best = math.inf  # fastest step so far, seconds per token
        self.history: list[list[int]] = []  # [step, threads] at each change
        torch.set_num_threads(self.max)

    def check(self, step: int) -> None:
        if self.auto and self.max > 1 and time.perf_counter() - self.checked >= self.every:
            one, many = _probe(1), _probe(self.max)
            # 1 only when many threads are slower than one: busy cores make them 40x slower, while on quiet cores
            # a probe can show them merely 1.1-1.3x faster (measured: a stricter rule fell back to 1 thread on a
            # quiet 2-core machine for half of a warm start, which then took 40% longer)
            self.now = 1 if many > one else self.max
            torch.set_num_threads(self.now)
            self.checked = time.perf_counter()
        if not self.history or self.history[-1][1] != self.now:
            self.history.append([step, self.now])

    def done(self, seconds: float, tokens: int) -> None:
        """A training step took `seconds` for `tokens` tokens."""
        rate = seconds / max(1, tokens)
        if rate > 3 * self.best:
            self.checked = -math.inf  # probe again before the next step
        self.best = min(self.best, rate)


def train(cfg: PretrainConfig, scn: Scenario, log=print, progress: Progress | None = None,
          threads: Threads | None = None, run_tasks: RunTasks | None = None) -> tuple[torch.nn.Module, list[dict]]:
    """`run_tasks`: the agents' episode loop the held-out evaluation runs (`evaluate`); needed when eval_tasks > 0."""
    _needs_run_tasks(cfg, run_tasks)
    torch.manual_seed(cfg.seed)
    tok = CharTokenizer()
    model = build_policy(cfg.model, tok.vocab_size, seed=cfg.seed).train()
    opt = make_optimizer(model, cfg)
    data = batches(scn, cfg, tok)
    phase0 = {f: c for f, c in scn.phases[0].concepts.items() if isinstance(c, str)}
    progress = progress or Progress(cfg.steps)
    threads = threads or Threads(cfg.threads)
    history, t0, c0 = [], time.perf_counter(), time.process_time()
    for step in range(cfg.steps):
        threads.check(step)
        ts = time.perf_counter()
        items = next(data)
        loss = optimizer_step(model, opt, tok, items, step, cfg)
        threads.done(time.perf_counter() - ts, sum(len(ids) for ids, _ in items))
        last = step == cfg.steps - 1
        ev = None
        if cfg.eval_tasks > 0 and (last or (cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0)):
            model.eval()
            te = time.perf_counter()
            ev = evaluate(model, scn, phase0, cfg.eval_tasks, run_tasks=run_tasks)
            model.train()
            history.append({"step": step + 1, "seconds": round(time.perf_counter() - t0, 1),
                            "cpu_seconds": round(time.process_time() - c0, 1), "loss": round(loss, 4),
                            "eval_seconds": round(time.perf_counter() - te, 2), **ev})
        progress.update(step + 1, loss, ev["reward"] if ev else None)
    if history and history[-1]["step"] == cfg.steps:
        row = history[-1]
        fams = ", ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in row.items() if k.startswith("reward/"))
        log(f"warm start: held-out greedy reward {row['reward']:.3f} ({fams}) on {cfg.eval_tasks} tasks; "
            f"{cfg.steps} steps in {fmt_duration(row['seconds'])} ({row['cpu_seconds']:.0f} CPU-s)")
    return model.eval(), history


def pretrain(cfg: PretrainConfig, out: str | Path | None = None, force: bool = False, log=print,
             progress: Progress | None = None, run_tasks: RunTasks | None = None) -> Path:
    """Train (or reuse the cached result) and return the policy directory. `run_tasks`: as for `train`."""
    path_scn = resolve_path(cfg.scenario)
    scn = load_scenario(path_scn)
    digest = config_hash(cfg, path_scn.read_text())
    out = Path(out) if out else Path(cfg.cache_dir) / f"warmstart-{digest}"
    meta = out / "pretrain.json"
    if not force and meta.is_file() and json.loads(meta.read_text()).get("hash") == digest:
        log(f"pretrain: reusing {out}")
        return out
    _needs_run_tasks(cfg, run_tasks)
    before = torch.get_num_threads()
    try:
        threads = Threads(cfg.threads)
        log(f"warm start: {cfg.steps} steps of {cfg.batch_size} demonstrations, {threads.max} threads"
            f"{' (auto; 1 while other work holds the cores)' if threads.auto and threads.max > 1 else ''}")
        t = time.perf_counter()
        model, history = train(cfg, scn, log, progress, threads, run_tasks)
    finally:
        torch.set_num_threads(before)
    save_policy(model, out, CharTokenizer())
    meta.write_text(json.dumps({"hash": digest, "config": to_dict(cfg), "seconds": round(time.perf_counter() - t, 1),
                                "threads": threads.history, "kernels": kernels(), "history": history}, indent=1))
    log(f"pretrain: saved {out}")
    return out


def main(argv: list[str], run_tasks: RunTasks | None = None) -> int:
    """`run_tasks`: the agents' episode loop, for the held-out evaluation (`sao pretrain` passes it)."""
    p = argparse.ArgumentParser(prog="sao pretrain", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", help="scenario file or name (default: default)")
    p.add_argument("--out", help="policy directory (default: <cache_dir>/warmstart-<hash>)")
    p.add_argument("--force", action="store_true", help="train even if a cached result exists")
    add_config_args(p, "PretrainConfig", "steps=760")
    args = p.parse_args(argv)
    overrides = list(args.overrides) + ([f"scenario={args.scenario}"] if args.scenario else [])
    try:
        cfg = load_config(PretrainConfig, args.config, overrides, section="pretrain")
        out = pretrain(cfg, args.out, args.force, run_tasks=run_tasks)
    except (ConfigError, ValueError) as e:
        print(f"sao pretrain: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0

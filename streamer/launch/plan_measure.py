"""The measured resource plan of `sao up --model DIR`: time one learner update and one agent generation of the run's
batch on this machine (1 and 2 threads), then give the cores to the bottleneck (`resources.choose_plan`; the
model and the choice are documented in streamer/launch/resources.py).

    timings, cached = measure(model_dir, learner_cfg, "torch", batch=32, new_tokens=32, cores=2, cache_dir=...)

The timings come from a child process (`python -m streamer.launch.plan_measure SPEC`: the models it builds leave
with it). The figures are cached per model, cores, batch shape and learner settings under runs/cache (a rerun does
not measure again); `apply_measured_plan` prints them with the chosen plan and writes both to
<run>/resource_plan.json.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from streamer.launch.resources import Timings, choose_plan, plan_resources, version_seconds

if TYPE_CHECKING:
    from learner.config import LearnerConfig

RunConfig = Any  # streamer.launch.run_config.RunConfig, which calls this module (an import back would be a circle)

PROMPT_TOKENS = 48  # a short task prompt through a chat template (SmolLM2's adds ~30 tokens to a one-line question)
THREADS = (1, 2)
BUDGET_S = 2.0  # repeat a timing (best of up to REPEATS) while it takes less than this in all
REPEATS = 3
MEASURED_ENGINES = ("torch", "hf")  # CPU engines; vLLM runs on a GPU, whose time no thread count changes


def synthetic_batch(n: int, prompt: int, new: int, vocab: int, seed: int = 0) -> list:
    """n trajectories of `prompt` + `new` random tokens, the new ones trained on (behaviour log-prob -1)."""
    import torch

    from streamer.wire.schema import Trajectory

    g = torch.Generator().manual_seed(seed)
    return [Trajectory(traj_id=str(i), task_id=str(i), family="plan", concept="plan", prompt_len=prompt,
                       tokens=torch.randint(8, vocab, (prompt + new,), generator=g).tolist(),
                       loss_mask=[0] * prompt + [1] * new, logprobs=[0.0] * prompt + [-1.0] * new,
                       reward=float(i % 2)) for i in range(n)]


def _best(fn: Callable[[], object]) -> float:
    times: list[float] = []
    while len(times) < REPEATS and (not times or sum(times) < BUDGET_S):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def per_thread_count(fn: Callable[[], object]) -> tuple[float, float]:
    """Best seconds of `fn` on 1 and on 2 torch threads, after one warm-up call (allocator, AdamW state)."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(THREADS[-1])
        fn()
        out = []
        for n in THREADS:
            torch.set_num_threads(n)
            out.append(_best(fn))
        return out[0], out[1]
    finally:
        torch.set_num_threads(before)


def time_learner(lc: LearnerConfig, model_dir: Path, trajectories: list) -> tuple[float, float]:
    """The learner's own step (`learner.trainer.step` prepare + update, policy trained) as its loop runs it."""
    from learner.train import build_models
    from learner.trainer.batching import by_length, collate
    from learner.trainer.step import prepare, update

    lc = copy.deepcopy(lc)
    lc.io.init = str(model_dir)
    models = build_models(lc)
    batch = collate(by_length(trajectories))

    def step() -> None:
        update(lc, models, batch, prepare(lc, models, batch, values_from_update=True), train_policy=True)

    return per_thread_count(step)  # the models (a 135M policy, critic and reference: GBs) freed on return


def time_agent(engine_name: str, model_dir: Path, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """One engine generating every prompt in one batch (as an agent does its share of a version), `new` tokens each:
    end tokens are switched off so that every row costs the same whatever the random prompt."""
    from learner.engines import make_engine
    from learner.models import load_policy, load_tokenizer

    model = load_policy(model_dir)
    model.config.eos_token_id = None
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = None
    engine = make_engine(engine_name, model, load_tokenizer(model_dir))
    return per_thread_count(lambda: engine.generate(prompts, new, temperature=1.0, seed=0))


def cache_key(model_dir: Path, lc: LearnerConfig, engine: str, batch: int, new: int, cores: int) -> dict:
    """What the timings depend on: the model (its path and config), the batch shape, the engine and the learner
    settings that change a step's work."""
    from streamer.wire.config import to_dict

    d = to_dict(lc)
    learner = {k: d[k] for k in ("policy", "value", "precision", "gradient_checkpointing") if k in d}
    learner.update({"estimator": lc.advantage.estimator, "loss": lc.loss.name, "kl": lc.loss.kl_coef > 0,
                    "micro": [lc.batch.micro_batch, lc.batch.micro_tokens]})
    return {"model": str(model_dir.resolve()), "config": (model_dir / "config.json").read_text(), "cores": cores,
            "batch": batch, "prompt_tokens": PROMPT_TOKENS, "new_tokens": new, "engine": engine, "learner": learner}


def measure(model_dir: str | Path, lc: LearnerConfig, engine: str, batch: int, new_tokens: int, cores: int,
            cache_dir: str | Path) -> tuple[Timings, Path, bool]:
    """The timings (cached under `cache_dir`), the cache file, and whether they came from it."""
    model_dir = Path(model_dir)
    key = cache_key(model_dir, lc, engine, batch, new_tokens, cores)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"resource-timings-{digest}.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return Timings(tuple(saved["learner_s"]), tuple(saved["agents_s"])), path, True
    t0 = time.monotonic()
    learner_s, agents_s = measure_in_child(model_dir, lc, engine, batch, new_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "learner_s": learner_s, "agents_s": agents_s,
                                "measured_in_s": round(time.monotonic() - t0, 1),
                                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
    return Timings(learner_s, agents_s), path, False


def measure_in_child(model_dir: Path, lc: LearnerConfig, engine: str, batch: int,
                     new_tokens: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """The timings from a child process (`main`), so that the models (GBs for a 135M policy with its critic,
    reference and AdamW state) are gone with it, not kept by the `sao up` process for the whole run."""
    from streamer.launch.resources import thread_env
    from streamer.wire.config import to_dict

    spec = {"model": str(model_dir), "learner": to_dict(lc), "engine": engine, "batch": batch, "new": new_tokens}
    proc = subprocess.run([sys.executable, "-m", "streamer.launch.plan_measure", json.dumps(spec)], text=True,
                          capture_output=True, env={**os.environ, **thread_env(THREADS[-1])})
    if proc.returncode != 0:
        raise RuntimeError(f"the measurement exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return tuple(out["learner_s"]), tuple(out["agents_s"])


def main(argv: list[str]) -> int:
    """Child of `measure_in_child`: argv[0] is its JSON spec; prints {"learner_s": [..], "agents_s": [..]}."""
    from learner.config import LearnerConfig
    from streamer.wire.config import load_config

    spec = json.loads(argv[0])
    model_dir = Path(spec["model"])
    lc = load_config(LearnerConfig, None, [], base=spec["learner"])
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    trajs = synthetic_batch(spec["batch"], PROMPT_TOKENS, spec["new"], vocab)
    learner_s = time_learner(lc, model_dir, trajs)
    gc.collect()  # the learner's models, before the engine's copy is loaded
    agents_s = time_agent(spec["engine"], model_dir, [t.tokens[:PROMPT_TOKENS] for t in trajs], spec["new"])
    print(json.dumps({"learner_s": learner_s, "agents_s": agents_s}), flush=True)
    return 0


def why_not_measured(cfg: RunConfig, cores: int) -> str:
    """Why the fixed rule applies to this run ('' when the plan is to be measured)."""
    up, a = cfg.launch, cfg.agent
    if not up.model:
        return "no --model (the embedded toy policy)"
    if up.agents or up.learner_threads or up.agent_threads:
        return "agents or threads given"
    if cores < 2:
        return "one core"
    if up.ray or cfg.learner.backend.name != "torch" or a.engine not in MEASURED_ENGINES or a.device != "cpu":
        return "not one host's CPU (ray, megatron, vllm or a GPU device)"
    return ""


def apply_measured_plan(cfg: RunConfig, log: Callable[[str], None] = print) -> bool:
    """With --model and no agents or threads given: measure (or read the cache), set launch.agents,
    launch.learner_threads and launch.agent_threads to the best split, print it and write <run>/resource_plan.json.
    Returns whether the launch section changed (its derived keys must then be filled again)."""
    up = cfg.launch
    cores = up.plan().cores
    if why_not_measured(cfg, cores):
        return False
    batch, staleness = up.pacing()
    try:
        t, cache, cached = measure(up.model, cfg.learner, cfg.agent.engine, batch, cfg.agent.max_new_tokens, cores,
                                   cfg.pretrain.cache_dir)
    except Exception as e:  # an optimisation only: a model the learner cannot step fails later, with its own error
        log(f"resource plan: not measured on {up.model} ({type(e).__name__}: {e}); the fixed rule applies")
        return False
    plan, secs = choose_plan(cores, t, staleness, up.eval)
    rule = plan_resources(cores, eval=up.eval)
    rule_s = version_seconds(t, cores, rule.learner_threads, rule.agents, rule.agent_threads, staleness)
    up.agents, up.learner_threads, up.agent_threads = plan.agents, plan.learner_threads, plan.agent_threads
    shape = f"{batch} x {PROMPT_TOKENS}+{cfg.agent.max_new_tokens} tokens"
    log(f"resource timings ({'cached' if cached else 'measured'}: {cache}): learner update of {shape} "
        f"{t.learner_s[0]:.2f} s on 1 thread, {t.learner_s[1]:.2f} s on 2; one agent generating them "
        f"{t.agents_s[0]:.2f} s / {t.agents_s[1]:.2f} s")
    log(f"measured plan: learner {plan.learner_threads} thread(s), {plan.agents} agent(s) x {plan.agent_threads} "
        f"thread(s): ~{secs:.2f} s per version, {batch / secs:.2f} trajectories/s (fixed rule: learner "
        f"{rule.learner_threads}, {rule.agents} x {rule.agent_threads}: ~{rule_s:.2f} s, {batch / rule_s:.2f}/s)")
    run_dir = Path(up.runs_dir) / up.run
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resource_plan.json").write_text(json.dumps({
        "model": up.model, "cores": cores, "batch": batch, "staleness": staleness, "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": cfg.agent.max_new_tokens, "timings": asdict(t), "cache": str(cache), "cached": cached,
        "chosen": {**asdict(plan), "version_s": secs, "trajectories_per_s": batch / secs},
        "fixed_rule": {**asdict(rule), "version_s": rule_s, "trajectories_per_s": batch / rule_s}}, indent=1))
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Online RL on a scenario's stream in one process: the real engine, environments, verifiers and learner
step, no broker. Each step samples the next `batch` tasks with the policy of `lag` steps ago (the
staleness an asynchronous pipeline would see), then trains on them with `Trainer.train_on`.

A configuration of the default scenario runs in about a minute on 2 cores, so it is how the default
scenario, the learning rate and the value-model designs are calibrated before `sao up` confirms them.

    .venv/bin/python -m experiments.online --init runs/cache/warmstart-XXXX --set optim.lr=1e-4
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import deque
from pathlib import Path

import msgspec
import pandas as pd
import torch

from learner.config import LearnerConfig
from learner.engines import make_engine
from learner.models import CharTokenizer
from learner.train import build_models
from learner.trainer.loop import Trainer
from simulator.generator import generate
from simulator.scenario import load_scenario, resolve_path
from streamer.agent.rollouts import run_tasks
from streamer.runs.adaptation import drift_recoveries
from streamer.wire.config import load_config
from streamer.wire.schema import DriftEvent, Task
from streamer.wire.settings import AgentSettings


def online_run(init: str, scenario: str, learner_sets: list[str], agent_sets: list[str], batch: int = 64,
               lag: int = 1, seed: int = 0, threads: int = 2, limit: int | None = None,
               log=print) -> tuple[pd.DataFrame, pd.DataFrame, list[dict]]:
    """(one row per trajectory, one row per learner step, the drift events); `limit`: the first tasks only."""
    torch.set_num_threads(threads)
    cfg = load_config(LearnerConfig, None, [f"io.init={init}", f"seed={seed}", *learner_sets])
    agent = load_config(AgentSettings, None, [f"concurrency={batch}", f"seed={seed}", *agent_sets])
    models = build_models(cfg)
    trainer = Trainer(cfg, models, source=None)
    tok = CharTokenizer()
    engine = make_engine("torch", copy.deepcopy(models.policy), tok)
    history = deque([copy.deepcopy(models.policy.state_dict())], maxlen=lag + 1)
    stream = list(generate(load_scenario(resolve_path(scenario)), seed=seed, t0=0.0, limit=limit))
    tasks = [t for t in stream if isinstance(t, Task)]
    rows, steps, t0 = [], [], time.monotonic()
    for i in range(0, len(tasks), batch):
        engine.load_state_dict(history[0], version=trainer.step - len(history) + 1)
        trajs = [t for ts in run_tasks(engine, tok, tasks[i:i + batch], agent) for t in ts]
        for t in trajs:
            rows.append({"seq": len(rows), "phase": t.phase, "response": tok.decode(t.tokens[t.prompt_len:]),
                         "family": t.family, "concept": t.concept,
                         "reward": t.reward, "success": t.success, "step": trainer.step,
                         "n_gen": sum(t.loss_mask), "policy_version": t.policy_version, "created_at": t.created_at})
        event = trainer.train_on(trajs)
        history.append(copy.deepcopy(models.policy.state_dict()))
        if event is not None:
            steps.append({"step": event.step, "version": event.step, "skipped": event.skipped,
                          "n": event.n_trajectories, **event.metrics})
        if (i // batch) % 10 == 0:
            recent = pd.DataFrame(rows[-batch * 10:])
            log(f"[{time.monotonic() - t0:5.0f}s] task {i + batch}/{len(tasks)} step {trainer.step} "
                f"reward {recent['reward'].mean():.3f} by family "
                f"{recent.groupby('family')['reward'].mean().round(2).to_dict()}")
    drifts = [msgspec.structs.asdict(m) for m in stream if isinstance(m, DriftEvent)]
    return pd.DataFrame(rows), pd.DataFrame(steps), drifts


def by_phase(traj: pd.DataFrame) -> pd.DataFrame:
    """Mean reward of each (phase, family, concept): first 64 / next 128 / rest, and the last 128."""
    out = []
    for (ph, fam, con), g in traj.groupby(["phase", "family", "concept"], sort=True):
        r = g["reward"].to_numpy()
        out.append({"phase": ph, "family": fam, "concept": con, "n": len(r), "first64": r[:64].mean(),
                    "next128": r[64:192].mean() if len(r) > 64 else float("nan"),
                    "rest": r[192:].mean() if len(r) > 192 else float("nan"), "last128": r[-128:].mean()})
    return pd.DataFrame(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", required=True, help="warm-start policy directory")
    p.add_argument("--scenario", default="default")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lag", type=int, default=1, help="sample with the policy of this many steps ago")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", dest="learner", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--agent-set", dest="agent", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="", help="write <out>.json (config, by-phase table, steps)")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    traj, steps, drifts = online_run(a.init, a.scenario, a.learner, a.agent, a.batch, a.lag, a.seed, a.threads)
    table = by_phase(traj)
    with pd.option_context("display.width", 200, "display.max_rows", 100):
        print(table.round(3).to_string(index=False))
    rec = drift_recoveries(traj, drifts, steps)
    cols = ["name", "family", "concept", "status", "pre_level", "initial_level", "trajectories", "learner_steps"]
    print(rec[rec["status"] != "unaffected"][cols].round(3).to_string(index=False))
    print("what the policy writes at the end, per (family, concept):")
    for (fam, con), g in traj.tail(512).groupby(["family", "concept"]):
        print(f"  {fam}/{con}: " + " | ".join(repr(r)[:60] for r in g["response"].head(3)))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        keep = [k for k in ("step", "learner/policy_loss", "learner/value_loss", "learner/clip_frac",
                            "learner/explained_variance", "learner/entropy", "learner/kl_k3") if k in steps]
        Path(a.out + ".json").write_text(json.dumps({
            "args": vars(a), "wall_s": round(time.monotonic() - t0, 1), "by_phase": table.to_dict("records"),
            "recoveries": rec.to_dict("records"),
            "steps": steps[keep].to_dict("records")}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A layout-free optimizer checkpoint (reshard.py) taken at one layout and resumed at another, under torchrun.

    python -m torch.distributed.run --nproc_per_node 2 -m learner.backends.megatron.reshard_check \
        --out reshard.json --dir DIR --source pp=2,ep=2 --target tp=2,ep=2

Both layouts hold the whole batch on every replica (data parallel 1), so they take the same steps. The learner at
`--source` takes an SAO policy and critic step, saves its weights (HF) and AdamW moments (`reshard.export`) into
`--dir`, and takes a second step. A learner at `--target` built from the saved weights, its moments loaded with
`reshard.load`, takes that second step too; rank 0 writes the largest difference of the two learners' weights after
it (expected: fp32 rounding of the two layouts' reductions), and the same for a learner that restarts AdamW instead
(expected ~lr: what the check would miss).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from learner.backends.megatron import parallel, reshard
from learner.backends.megatron.learner import MegatronLearner, MegatronOptions, OptimSettings
from learner.backends.megatron.parity import _hf_models, batch_for, sao, with_behaviour
from learner.backends.megatron.zero_check import _value_loss

_KEYS = {"tp": "tensor_parallel", "pp": "pipeline_parallel", "ep": "expert_parallel"}


def _options(spec: str) -> MegatronOptions:
    kw = {_KEYS[k]: int(v) for k, v in (p.split("=") for p in spec.split(",") if p)}
    return MegatronOptions(**kw, micro_batches=3 if kw.get("pipeline_parallel", 1) > 1 else 1)


def _weights(lrn) -> dict[str, torch.Tensor]:
    return {**lrn.policy_state_dict(), **{"v." + k: t for k, t in lrn.value_state_dict().items()}}


def _step(lrn, batch: dict) -> None:
    lrn.policy_step(batch)
    lrn.value_step(batch)


def _diff(a: dict, b: dict) -> dict[str, float]:
    """The largest difference of the policy's tensors and of the critic's."""
    out = {}
    for k in a:
        side = "value" if k.startswith("v.") else "policy"
        out[side] = max(out.get(side, 0.0), float((a[k] - b[k]).abs().max()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--source", required=True, help="e.g. pp=2,ep=2")
    ap.add_argument("--target", required=True, help="e.g. tp=2,ep=2")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SAO_TEST_THREADS", "1")))
    torch.manual_seed(0)
    d, optim = Path(args.dir), OptimSettings(lr=1e-3, grad_clip=1.0)
    policy, value = _hf_models(None)
    src = MegatronLearner(policy, value, _options(args.source), optim, sao, _value_loss)
    if src.layout["dp"] != 1:
        raise SystemExit(f"--source {args.source}: data parallel {src.layout['dp']}, this check needs 1")
    (batch,) = with_behaviour([batch_for(0, policy.config.vocab_size)], policy)
    with torch.no_grad():
        batch["old_values"] = src.values(batch["input_ids"], batch["attention_mask"])
        batch["returns"] = batch["old_values"] + 0.3 * batch["noise"]
    _step(src, batch)
    # cloned: a renamed tensor of the export is the live parameter, which the next step changes
    saved_p, saved_v = ({k: t.clone() for k, t in sd.items()} for sd in (src.policy_state_dict(),
                                                                         src.value_state_dict()))
    moments = {n: reshard.export(src, n) for n in ("policy", "value")}
    if dist.get_rank() == 0:
        for n, (tensors, meta) in moments.items():
            save_file(tensors, str(d / f"optim_{n}.hf.safetensors"))
            (d / f"optim_{n}.hf.json").write_text(json.dumps(meta))
    dist.barrier()
    _step(src, batch)
    want = {k: t.clone() for k, t in _weights(src).items()}
    out = {"source": args.source, "target": args.target, "world_size": dist.get_world_size()}
    for restore in (True, False):
        policy.load_state_dict(saved_p)
        value.load_state_dict(saved_v)
        tgt = MegatronLearner(policy, value, _options(args.target), optim, sao, _value_loss)
        if restore:
            for n in ("policy", "value"):
                reshard.load(tgt, n, d / f"optim_{n}.hf.safetensors",
                             json.loads((d / f"optim_{n}.hf.json").read_text()))
        _step(tgt, batch)
        out["max_abs_resumed" if restore else "max_abs_adam_restarted"] = _diff(_weights(tgt), want)
    out["moments"] = len(load_file(str(d / "optim_policy.hf.safetensors")))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out, indent=2))
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

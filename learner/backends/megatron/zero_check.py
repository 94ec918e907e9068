"""The sharded optimizer (`zero.ShardedAdamW`) against the replicated AdamW, run under torchrun.

    python -m torch.distributed.run --nproc_per_node 2 -m learner.backends.megatron.zero_check \
        --out zero.json [--ep 1] [--tp 1] [--model-dir DIR]

Two learners from the same HF weights, one with `shard_optimizer`, take the same 3 SAO steps (policy and critic, the
critic through `value_step`); written by rank 0: the largest difference of their weights after each step (AdamW is
elementwise: expected 0), and per rank the bytes of optimizer state and of parameters.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from learner.backends.megatron import parallel
from learner.backends.megatron.learner import MegatronLearner, MegatronOptions, OptimSettings
from learner.backends.megatron.parity import _hf_models, _max_abs, batch_for, sao, with_behaviour
from learner.backends.megatron.zero import state_bytes

STEPS = 3


def _value_loss(v, b):
    from learner.algorithms import value_loss

    return value_loss(v, b["old_values"], b["returns"], b["loss_mask"], clip=0.2, agg="token_mean")


def _run(opts: MegatronOptions, model_dir: str | None) -> tuple[list[dict], dict]:
    policy, value = _hf_models(model_dir)
    lrn = MegatronLearner(policy, value, opts, OptimSettings(lr=1e-3, grad_clip=1.0), sao, _value_loss)
    lay = parallel.layout()
    batches = with_behaviour([batch_for(r, policy.config.vocab_size) for r in range(lay["dp"])], policy)
    mine = batches[lay["dp_rank"]]
    with torch.no_grad():
        mine["old_values"] = lrn.values(mine["input_ids"], mine["attention_mask"])
        mine["returns"] = mine["old_values"] + 0.3 * mine["noise"]
    after = []
    for _ in range(STEPS):
        lrn.policy_step(mine)
        lrn.value_step(mine)
        after.append({**lrn.policy_state_dict(), **{"v." + k: t for k, t in lrn.value_state_dict().items()}})
    mem = {"optimizer_state_bytes": state_bytes(lrn.opt) + state_bytes(lrn.value_opt),
           "param_bytes": sum(p.numel() * p.element_size() for m in (lrn.policy, lrn.value) for p in m.parameters())}
    return after, mem


def _per_rank(x: int) -> list[int]:
    t = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    t[dist.get_rank()] = x
    dist.all_reduce(t)
    return t.tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SAO_TEST_THREADS", "1")))
    torch.manual_seed(0)
    parallel.init(args.ep, 0, args.tp)
    out: dict = {"world_size": dist.get_world_size(), "ep": args.ep, "tp": args.tp, "dp": parallel.layout()["dp"]}
    runs = {}
    for shard in (False, True):
        after, mem = _run(MegatronOptions(expert_parallel=args.ep, tensor_parallel=args.tp, shard_optimizer=shard),
                          args.model_dir)
        name = "sharded" if shard else "replicated"
        runs[name] = after
        out[name] = {k: _per_rank(v) for k, v in mem.items()}
    sh, rep = runs["sharded"], runs["replicated"]
    out["max_abs_per_step"] = [max(_max_abs(a[k], b[k]) for k in a) for a, b in zip(sh, rep)]
    out["moved_per_step"] = [max(_max_abs(a[k], b[k]) for k in a) for a, b in zip(sh[1:], sh)]
    return parallel.report_and_shutdown(out, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

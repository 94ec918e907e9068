"""Parity of the megatron backend at pipeline parallelism against the HF/torch model, run under torchrun.

    python -m torch.distributed.run --nproc_per_node 2 -m learner.backends.megatron.parity_pp \
        --out parity_pp.json --pp 2 [--tp 1] [--ep 1] [--model-dir DIR]

The policy runs through megatron-core's 1F1B schedule (`pipeline.run`); batches, models and the SAO loss are
`parity`'s. Measured, written by rank 0 as JSON (the tests set the thresholds):
  logits_vs_hf, logprobs_vs_hf   last stage's logits / every stage's log-probs vs HF, real tokens
  grad_rel_m{M}                  max per-tensor ||g_megatron - g_hf|| / ||g_hf|| over every HF parameter, the
                                 loss split in M micro-batches (1 and 3: warm-up, 1F1B and cool-down all run)
  step_{sgd,adamw}_m{M}_*        one SAO step vs the torch step (as parity.check_step)
  roundtrip_exact                HF -> megatron stages -> gathered HF is bit-identical
  values_vs_hf, value_step_m{M}_*, value_roundtrip_exact   the critic the same way (clipped value loss, AdamW)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from learner.backends.megatron import convert, grads, parallel, pipeline, tp
from learner.backends.megatron.learner import MegatronLearner, MegatronOptions, OptimSettings
from learner.backends.megatron.model import mapped_tensors
from learner.backends.megatron.parity import _all_max, _hf_grads, _hf_models, _max_abs, batch_for, sao, with_behaviour


def _setup(opts: MegatronOptions, model_dir: str | None, lr: float, clip: float | None):
    from megatron.core import parallel_state as ps

    policy, _ = _hf_models(model_dir)
    lay = parallel.layout()
    batches = with_behaviour([batch_for(r, policy.config.vocab_size) for r in range(lay["dp"])], policy)
    lrn = MegatronLearner(policy, None, opts, OptimSettings(lr=lr, grad_clip=clip), sao)
    assert ps.get_pipeline_model_parallel_world_size() == opts.pipeline_parallel
    return policy, batches, batches[lay["dp_rank"]], lrn


def _hf_of(lrn: MegatronLearner, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron tensors of this rank (params or grads) as the whole HF state dict (collective)."""
    from megatron.core import parallel_state as ps

    local = convert.megatron_to_hf(tp.gather_state(tensors, lrn.layout), lrn.hf_config, lrn.ep_rank, lrn.ep_size,
                                   stage=lrn.stage)
    full = convert.gather_experts(local, lrn.hf_config, ps.get_expert_model_parallel_group())
    return pipeline.gather_stages(full, lrn.hf_config, torch.float32)


def check_forward(opts: MegatronOptions, out: dict, model_dir: str | None) -> None:
    from learner.models.scoring import policy_logits, token_logprobs

    policy, _, mine, lrn = _setup(opts, model_dir, 1e-3, None)
    ids, mask = mine["input_ids"], mine["attention_mask"]
    with torch.no_grad():
        res = pipeline.run(lrn.policy, pipeline.micro_batches(mine, 1, lrn.layout["tp"]), None, forward_only=True)
        h_logits = policy_logits(policy, ids, mask)
        out["logits_vs_hf"] = _all_max(_max_abs(res[0]["logits"], h_logits, mask) if res else 0.0)
        out["logits_on_last_stage_only"] = bool(_all_max(float(bool(res) != lrn.stage.last)) == 0.0)
        out["logprobs_vs_hf"] = _all_max(_max_abs(lrn.forward_logprobs(ids, mask), token_logprobs(policy, ids, mask),
                                                  mask))
    hf_sd, back = policy.state_dict(), lrn.policy_state_dict()
    out["roundtrip_exact"] = bool(_all_max(float(set(back) != set(hf_sd) or any(
        not torch.equal(back[k], hf_sd[k]) for k in hf_sd))) == 0.0)


def check_grads(opts: MegatronOptions, out: dict, model_dir: str | None) -> None:
    policy, batches, mine, lrn = _setup(opts, model_dir, 1e-3, None)
    lrn.policy.train()
    lrn.opt.zero_grad(set_to_none=True)
    pipeline.train(lrn.policy, mine, opts.micro_batches, lrn.layout["tp"], sao)
    named = [(n, p) for n, p in lrn.policy.named_parameters() if p.requires_grad]
    grads.allreduce_grads(named)
    g = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in mapped_tensors(lrn.policy).items()}
    gm, gh = _hf_of(lrn, g), _hf_grads(policy, batches, sao)
    rel, zero_mismatch = 0.0, 0
    for n, h in gh.items():
        hn = float(h.norm())
        if hn == 0.0:
            zero_mismatch += int(float(gm[n].norm()) != 0.0)
            continue
        rel = max(rel, float((gm[n] - h).norm()) / hn)
    m = opts.micro_batches
    out[f"grad_rel_m{m}"] = _all_max(rel)
    out[f"grad_zero_mismatch_m{m}"] = int(_all_max(zero_mismatch))
    out[f"grad_tensors_m{m}"] = len(gh)


def check_step(opts: MegatronOptions, opt_name: str, out: dict, model_dir: str | None) -> None:
    from learner.models.scoring import token_logprobs

    lr = 1e-3 if opt_name == "adamw" else 0.5
    policy, batches, mine, lrn = _setup(opts, model_dir, lr, 1.0)
    if opt_name == "sgd":
        lrn.opt = torch.optim.SGD(lrn.policy.parameters(), lr=lr)
    stats = lrn.policy_step(mine)
    after_m = lrn.policy_state_dict()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    opt = (torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
           if opt_name == "adamw" else torch.optim.SGD(policy.parameters(), lr=lr))
    losses = [sao(token_logprobs(policy, b["input_ids"], b["attention_mask"]), b)[0] for b in batches]
    (sum(losses) / len(losses)).backward()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
    opt.step()
    after_t = policy.state_dict()
    key = f"step_{opt_name}_m{opts.micro_batches}"
    out[f"{key}_max_abs"] = _all_max(max(_max_abs(after_m[k], after_t[k]) for k in after_t))
    grads_t = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    out[f"{key}_max_abs_grad_gt_1e-5"] = _all_max(max(
        _max_abs(after_m[k], after_t[k], grads_t[k].abs() > 1e-5) for k in grads_t))
    out[f"{key}_max_update"] = max(_max_abs(after_t[k], before[k]) for k in after_t)
    out[f"{key}_grad_norm"] = [stats["grad_norm"], torch_norm]
    out[f"{key}_loss"] = _all_max(stats.get("loss", float("-inf")))  # the last stage's


def check_value(opts: MegatronOptions, out: dict, model_dir: str | None) -> None:
    """The critic through the schedule: values, one clipped-value-loss AdamW step (lr 1e-3, clip 1.0) vs H2's
    ValueModel, and the critic's round trip."""
    from learner.algorithms import value_loss
    from learner.config import LearnerConfig

    vcfg = LearnerConfig().value
    policy, value = _hf_models(model_dir)
    lay = parallel.layout()
    batches = with_behaviour([batch_for(r, policy.config.vocab_size) for r in range(lay["dp"])], policy)
    with torch.no_grad():
        for b in batches:
            b["old_values"] = value(b["input_ids"], b["attention_mask"])
            b["returns"] = b["old_values"] + 0.3 * b["noise"]

    def vl(v, b):
        return value_loss(v, b["old_values"], b["returns"], b["loss_mask"], clip=vcfg.value_clip, agg=vcfg.agg)

    mine = batches[lay["dp_rank"]]
    lrn = MegatronLearner(policy, value, opts, OptimSettings(lr=1e-3, value_lr=1e-3, grad_clip=1.0), sao, vl)
    m = opts.micro_batches
    if m == 1:
        with torch.no_grad():
            out["values_vs_hf"] = _all_max(_max_abs(lrn.values(mine["input_ids"], mine["attention_mask"]),
                                                    value(mine["input_ids"], mine["attention_mask"]),
                                                    mine["attention_mask"]))
        vsd, back = value.state_dict(), lrn.value_state_dict()
        out["value_roundtrip_exact"] = bool(_all_max(float(set(back) != set(vsd) or any(
            not torch.equal(back[k], vsd[k]) for k in vsd))) == 0.0)
    stats = lrn.value_step(mine)
    after_m = lrn.value_state_dict()
    opt = torch.optim.AdamW(value.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    losses = [vl(value(b["input_ids"], b["attention_mask"]), b)[0] for b in batches]
    (sum(losses) / len(losses)).backward()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(value.parameters(), 1.0))
    opt.step()
    after_t = value.state_dict()
    g = {n: p.grad for n, p in value.named_parameters() if p.grad is not None}
    out[f"value_step_m{m}_max_abs"] = _all_max(max(_max_abs(after_m[k], after_t[k]) for k in after_t))
    out[f"value_step_m{m}_max_abs_grad_gt_1e-5"] = _all_max(max(
        _max_abs(after_m[k], after_t[k], g[k].abs() > 1e-5) for k in g))
    out[f"value_step_m{m}_grad_norm"] = [stats["grad_norm"], torch_norm]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SAO_TEST_THREADS", "1")))
    torch.manual_seed(0)
    parallel.init(args.ep, 0, args.tp, args.pp, 1)
    out: dict = {"world_size": dist.get_world_size(), "pp": args.pp, "tp": args.tp, "ep": args.ep}
    src = args.model_dir
    for m in (1, 3):
        opts = MegatronOptions(expert_parallel=args.ep, tensor_parallel=args.tp, pipeline_parallel=args.pp,
                               micro_batches=m)
        if m == 1:
            check_forward(opts, out, src)
        check_grads(opts, out, src)
        check_step(opts, "sgd", out, src)
        check_step(opts, "adamw", out, src)
        check_value(opts, out, src)
    return parallel.report_and_shutdown(out, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

"""Parity check of the megatron backend against the HF/torch model, run under torchrun.

    python -m torch.distributed.run --nproc_per_node 2 -m learner.backends.megatron.parity \
        --out parity.json [--ep 2] [--tp 1] [--etp 1] [--model-dir DIR]

Every rank builds the same HF policy (the tiny Qwen3-MoE of `ModelConfig`, seeded, or the HF
causal LM saved in --model-dir, any mapped architecture) and the batch of its data-parallel rank
(the TP ranks of one replica share it).
Measured, and written by rank 0 as JSON (max abs / relative differences; the tests set the
thresholds):
  logits_ep{N}_vs_hf   megatron logits (EP=N) vs HF logits on the rank's batch, real tokens
  logprobs_ep{N}_vs_hf megatron per-token log-probs vs HF's (learner.models.scoring), real tokens
  logits_ep1_vs_epN    EP=1 vs EP=N megatron logits
  values_vs_hf         megatron critic vs H2's ValueModel
  grad_rel             per-tensor ||g_megatron - g_hf|| / ||g_hf|| of the mean-over-ranks loss
  step_sgd / step_adamw  max |w_megatron - w_torch| after one SAO step (torch: HF model, same
                       loss = mean over the ranks' SAO losses, same optimizer, clip 1.0)
  roundtrip_exact      HF -> megatron (EP=N) -> gathered HF is bit-identical
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from learner.backends.megatron import convert, parallel, tp
from learner.backends.megatron.learner import MegatronLearner, OptimSettings
from learner.backends.megatron.model import megatron_logits

B, T = 3, 14  # sequences per rank, tokens per sequence


def batch_for(rank: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(4, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 4:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    ids = torch.where(mask.bool(), ids, torch.zeros_like(ids))
    loss_mask = mask.clone()
    loss_mask[:, :5] = 0  # prompt
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
            "advantages": torch.randn(B, T, generator=g),
            "noise": torch.randn(B, T, generator=g),
            "rewards": (torch.rand(B, generator=g) > 0.5).float()}


def with_behaviour(batches: list[dict], policy) -> list[dict]:
    """Behaviour log-probs = the model's own + N(0, 0.15^2) noise: ~20% of ratios leave the band."""
    from learner.models.scoring import token_logprobs

    with torch.no_grad():
        return [{**b, "old_logp": token_logprobs(policy, b["input_ids"], b["attention_mask"])
                 + 0.15 * b["noise"]} for b in batches]


def sao(logp, b):
    from learner.algorithms import policy_loss

    return policy_loss("sao", logp, b["old_logp"], b["advantages"], b["loss_mask"])


def _hf_models(model_dir: str | None, seed: int = 0):
    """(HF policy, H2 ValueModel of its backbone): the tiny Qwen3-MoE, or the model in `model_dir`."""
    from transformers import AutoModelForCausalLM

    from learner.models.policy import build_policy
    from learner.models.value import ValueModel

    policy = (build_policy(seed=seed) if model_dir is None
              else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    return policy, ValueModel.from_policy(policy, seed=seed + 1)


def _max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    d = (a - b).abs()
    if mask is not None:
        d = d[mask.bool()]
    return float(d.max()) if d.numel() else 0.0


def _all_max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _hf_grads(policy, batches, loss_fn) -> dict[str, torch.Tensor]:
    from learner.models.scoring import token_logprobs

    policy.zero_grad(set_to_none=True)
    losses = [loss_fn(token_logprobs(policy, b["input_ids"], b["attention_mask"]), b)[0] for b in batches]
    (sum(losses) / len(losses)).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in policy.named_parameters()}


def _megatron_grads(lrn: MegatronLearner) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    from learner.backends.megatron.model import mapped_tensors

    # buffers (GLM's router expert_bias) have no gradient: zeros, so the conversion finds every name
    g = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in mapped_tensors(lrn.policy).items()}
    local = convert.megatron_to_hf(tp.gather_state(g, lrn.layout), lrn.hf_config, lrn.ep_rank, lrn.ep_size)
    return convert.gather_experts(local, lrn.hf_config, ps.get_expert_model_parallel_group())


def check_forward_and_grads(ep: int, out: dict, model_dir: str | None = None) -> dict[str, torch.Tensor]:
    from learner.backends.megatron import grads
    from learner.models.scoring import policy_logits, token_logprobs

    rank, world = _dp()
    policy, value = _hf_models(model_dir)
    vocab = policy.config.vocab_size
    batches = with_behaviour([batch_for(r, vocab) for r in range(world)], policy)
    mine = batches[rank]
    lrn = MegatronLearner(policy, value, _opts(ep), OptimSettings(lr=1e-3, grad_clip=None), sao)
    with torch.no_grad():
        m_logits = megatron_logits(lrn.policy, mine["input_ids"], mine["attention_mask"])
        h_logits = policy_logits(policy, mine["input_ids"], mine["attention_mask"])
        out[f"logits_ep{ep}_vs_hf"] = _all_max(_max_abs(m_logits, h_logits, mine["attention_mask"]))
        m_logp = lrn.forward_logprobs(mine["input_ids"], mine["attention_mask"])
        h_logp = token_logprobs(policy, mine["input_ids"], mine["attention_mask"])
        out[f"logprobs_ep{ep}_vs_hf"] = _all_max(_max_abs(m_logp, h_logp, mine["attention_mask"]))
        m_v = lrn.values(mine["input_ids"], mine["attention_mask"])
        h_v = value(mine["input_ids"], mine["attention_mask"])
        out[f"values_ep{ep}_vs_hf"] = _all_max(_max_abs(m_v, h_v, mine["attention_mask"]))
    # gradients of the mean over ranks of the SAO loss
    logp = lrn.forward_logprobs(mine["input_ids"], mine["attention_mask"])
    sao(logp, mine)[0].backward()
    grads.allreduce_grads(list(lrn.policy.named_parameters()))
    gm, gh = _megatron_grads(lrn), _hf_grads(policy, batches, sao)
    rel, zero_mismatch = 0.0, 0  # gh: named_parameters, so a tied lm_head is the embedding, counted once
    for n, h in gh.items():
        hn = float(h.norm())
        if hn == 0.0:
            zero_mismatch += int(float(gm[n].norm()) != 0.0)
            continue
        rel = max(rel, float((gm[n] - h).norm()) / hn)
    out[f"grad_rel_ep{ep}"] = _all_max(rel)
    out[f"grad_zero_mismatch_ep{ep}"] = int(_all_max(zero_mismatch))
    out[f"grad_tensors_ep{ep}"] = len(gh)
    hf_sd = policy.state_dict()
    round_trip = lrn.policy_state_dict()
    out[f"roundtrip_exact_ep{ep}"] = bool(_all_max(float(
        set(round_trip) != set(hf_sd) or any(not torch.equal(round_trip[k], hf_sd[k]) for k in hf_sd))) == 0.0)
    vsd = value.state_dict()
    v_round = lrn.value_state_dict()
    out[f"value_roundtrip_exact_ep{ep}"] = bool(_all_max(float(
        set(v_round) != set(vsd) or any(not torch.equal(v_round[k], vsd[k]) for k in vsd))) == 0.0)
    return m_logits.detach()


def check_step(ep: int, opt_name: str, out: dict, model_dir: str | None = None) -> None:
    """One SAO step on megatron vs the same step on the HF model with torch's optimizer."""
    from learner.models.scoring import token_logprobs

    rank, world = _dp()
    policy, _ = _hf_models(model_dir)
    batches = with_behaviour([batch_for(r, policy.config.vocab_size) for r in range(world)], policy)
    lr = 1e-3 if opt_name == "adamw" else 0.5
    lrn = MegatronLearner(policy, None, _opts(ep), OptimSettings(lr=lr, grad_clip=1.0), sao)
    if opt_name == "sgd":
        lrn.opt = torch.optim.SGD(lrn.policy.parameters(), lr=lr)
    stats = lrn.policy_step(batches[rank])
    after_m = lrn.policy_state_dict()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    opt = (torch.optim.AdamW(policy.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
           if opt_name == "adamw" else torch.optim.SGD(policy.parameters(), lr=lr))
    opt.zero_grad()
    losses = [sao(token_logprobs(policy, b["input_ids"], b["attention_mask"]), b)[0] for b in batches]
    (sum(losses) / len(losses)).backward()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
    opt.step()
    after_t = policy.state_dict()
    out[f"step_{opt_name}_ep{ep}_max_abs"] = _all_max(max(_max_abs(after_m[k], after_t[k]) for k in after_t))
    # Adam's first update is lr * g / (|g| + eps): where |g| is near eps, fp32 noise in g moves it
    # by up to lr. Away from that region the two updates must agree to fp32 rounding.
    grads_t = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    out[f"step_{opt_name}_ep{ep}_max_abs_grad_gt_1e-5"] = _all_max(max(
        _max_abs(after_m[k], after_t[k], grads_t[k].abs() > 1e-5) for k in grads_t))
    out[f"step_{opt_name}_ep{ep}_max_update"] = max(_max_abs(after_t[k], before[k]) for k in after_t)
    out[f"step_{opt_name}_ep{ep}_grad_norm"] = [stats["grad_norm"], torch_norm]
    out[f"step_{opt_name}_ep{ep}_clip_frac"] = stats.get("clip_frac", 0.0)


def check_value_step(ep: int, out: dict, model_dir: str | None = None) -> None:
    """`make_megatron_learner(LearnerConfig())`: one critic step (clipped value loss, AdamW,
    clip 1.0) vs the same step on H2's ValueModel; then one policy step runs."""
    from learner.algorithms import value_loss
    from learner.backends.megatron.learner import make_megatron_learner
    from learner.config import LearnerConfig

    cfg = LearnerConfig()
    cfg.loss.kl_coef = 0.0  # the KL anchor is torch-only (LearnerConfig refuses it on megatron)
    rank, world = _dp()
    policy, value = _hf_models(model_dir)
    batches = with_behaviour([batch_for(r, policy.config.vocab_size) for r in range(world)], policy)
    with torch.no_grad():
        for b in batches:
            b["old_values"] = value(b["input_ids"], b["attention_mask"])
            b["returns"] = b["old_values"] + 0.3 * b["noise"]  # first step: V = V_old, the clip cannot bind
    lrn = make_megatron_learner(cfg, policy, value, _opts(ep))
    stats = lrn.value_step(batches[rank])
    after_m = lrn.value_state_dict()
    opt = torch.optim.AdamW(value.parameters(), lr=cfg.optim.value_lr, betas=cfg.optim.betas,
                            weight_decay=cfg.optim.weight_decay)
    losses = [value_loss(value(b["input_ids"], b["attention_mask"]), b["old_values"], b["returns"],
                         b["loss_mask"], clip=cfg.value.value_clip, agg=cfg.value.agg)[0] for b in batches]
    (sum(losses) / len(losses)).backward()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(value.parameters(), cfg.optim.grad_clip))
    opt.step()
    grads_t = {n: p.grad for n, p in value.named_parameters() if p.grad is not None}
    after_t = value.state_dict()
    out[f"value_step_ep{ep}_max_abs"] = _all_max(max(_max_abs(after_m[k], after_t[k]) for k in after_t))
    out[f"value_step_ep{ep}_max_abs_grad_gt_1e-5"] = _all_max(max(
        _max_abs(after_m[k], after_t[k], grads_t[k].abs() > 1e-5) for k in grads_t))
    out[f"value_step_ep{ep}_grad_norm"] = [stats["grad_norm"], torch_norm]
    out[f"value_step_ep{ep}_clip_frac"] = stats.get("value_clip_frac", -1.0)
    before = {k: v.clone() for k, v in lrn.policy_state_dict().items()}
    pstats = lrn.policy_step(batches[rank])
    moved = max(_max_abs(v, before[k]) for k, v in lrn.policy_state_dict().items())
    out[f"factory_policy_step_ep{ep}"] = {"loss": pstats["loss"], "max_update": moved}


def _trainer_batch(bs: list[dict]):
    from learner.trainer.batching import Batch

    cat = {k: torch.cat([b[k] for b in bs]) for k in ("input_ids", "attention_mask", "loss_mask",
                                                      "old_logp", "rewards")}
    lm = cat["loss_mask"].float()
    return Batch(cat["input_ids"], cat["attention_mask"], lm, torch.where(lm.bool(), cat["old_logp"], 0.0),
                 cat["rewards"], [])


def check_trainer_step(ep: int, out: dict, model_dir: str | None = None) -> None:
    """The torch trainer's own step code (learner.trainer.step: prepare, value_backward,
    policy_backward) on megatron via its backend's models, vs its `update()` on the HF models over the
    concatenated batch. Both ranks' loss masks have the same token count, so the global token
    mean equals the mean over ranks of the rank means."""
    from learner.backends.megatron.learner import megatron_trainer_models
    from learner.config import LearnerConfig
    from learner.trainer import step as tstep

    cfg = LearnerConfig()
    cfg.loss.kl_coef = 0.0  # the KL anchor is torch-only (LearnerConfig refuses it on megatron)
    rank, world = _dp()
    policy, value = _hf_models(model_dir)
    batches = with_behaviour([batch_for(r, policy.config.vocab_size) for r in range(world)], policy)
    mm, lrn = megatron_trainer_models(cfg, policy, value, _opts(ep))
    pol, val = mm.policy, mm.value
    local = _trainer_batch([batches[rank]])
    ref = tstep.prepare(cfg, mm, local)
    lrn.opt.zero_grad(set_to_none=True)
    lrn.value_opt.zero_grad(set_to_none=True)
    tstep.value_backward(cfg, mm, local, ref)
    vnorm = mm.clip_grads(val, cfg.optim.grad_clip)
    pm = tstep.policy_backward(cfg, mm, local, ref)
    pnorm = mm.clip_grads(pol, cfg.optim.grad_clip)
    lrn.value_opt.step()
    lrn.opt.step()
    after_p, after_v = lrn.export_hf_policy().state_dict(), lrn.export_hf_value().state_dict()

    tm = tstep.build_optimizers(cfg, policy.train(), value.train())
    full = _trainer_batch(batches)
    metrics, applied = tstep.update(cfg, tm, full, tstep.prepare(cfg, tm, full), train_policy=True)
    res = {"applied": applied, "grad_norm": [pnorm, metrics["grad_norm"]],
           "value_grad_norm": [vnorm, metrics["value_grad_norm"]], "clip_frac": pm.get("clip_frac")}
    for name, after_m, model in (("policy", after_p, policy), ("value", after_v, value)):
        after_t = model.state_dict()
        g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        res[f"{name}_max_abs"] = _all_max(max(_max_abs(after_m[k], after_t[k]) for k in after_t))
        res[f"{name}_max_abs_grad_gt_1e-5"] = _all_max(max(
            _max_abs(after_m[k], after_t[k], g[k].abs() > 1e-5) for k in g))
    out[f"trainer_step_ep{ep}"] = res


LAYOUT = {"tensor_parallel": 1, "expert_tensor_parallel": 1}  # main() sets them from --tp / --etp


def _opts(ep: int):
    from learner.backends.megatron.learner import MegatronOptions

    return MegatronOptions(expert_parallel=ep, **LAYOUT)


def _dp() -> tuple[int, int]:
    """(this rank's data-parallel rank, the number of replicas): the TP ranks of a replica share its batch."""
    lay = parallel.layout()
    return lay["dp_rank"], lay["dp"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism")
    ap.add_argument("--etp", type=int, default=1, help="expert tensor parallelism")
    ap.add_argument("--model-dir", default=None, help="an HF causal LM directory (default: the tiny Qwen3-MoE)")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SAO_TEST_THREADS", "1")))
    torch.manual_seed(0)
    LAYOUT.update(tensor_parallel=args.tp, expert_tensor_parallel=args.etp)
    parallel.init(args.ep, 0, args.tp, 1, args.etp)
    src = args.model_dir
    out: dict = {"world_size": dist.get_world_size(), "ep": args.ep, "tp": args.tp, "etp": args.etp}
    logits_ep = check_forward_and_grads(args.ep, out, src)
    check_step(args.ep, "sgd", out, src)
    check_step(args.ep, "adamw", out, src)
    check_value_step(args.ep, out, src)
    check_trainer_step(args.ep, out, src)
    if args.ep > 1:
        parallel.init(1, 0, args.tp, 1, args.etp)
        logits_1 = check_forward_and_grads(1, out, src)
        out[f"logits_ep1_vs_ep{args.ep}"] = _all_max(_max_abs(logits_1, logits_ep))
    return parallel.report_and_shutdown(out, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

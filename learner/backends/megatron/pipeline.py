"""Pipeline parallelism: the policy's layers split over stages, run by megatron-core's 1F1B schedule.

Each pipeline stage builds the GPTModel of its own layers (`model.build_gpt`: pre_process on the first stage, the
final norm and output layer on the last); `forward_backward_pipelining_without_interleaving` moves the hidden states
forward and their gradients back between stages with point-to-point sends (gloo on CPU; `cpu_compat` patches the
schedule's one CUDA-only tensor). The loss is computed on the last stage only.

Layer split: L // PP layers per stage, the first stage taking the remainder (megatron's
num_layers_in_first_pipeline_stage); `parallel.stage_ranges` is that split, checked against the built model.

Micro-batches: the batch rows are cut into M micro-batches; micro-batch m's loss is weighted by its share of the
batch's loss tokens, so the sum equals the whole batch's loss for token-mean aggregation (the default, `loss.agg`
token_mean); other aggregations need M = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from learner.backends.megatron.parallel import stage_ranges


@dataclass(frozen=True)
class Stage:
    layers: tuple[int, ...]  # the global HF layer indices this stage holds (megatron names them 0.. locally)
    first: bool = True  # holds the embedding
    last: bool = True  # holds the final norm and the output layer


def stage_of(model, n_layers: int, pp: int, pp_rank: int) -> Stage:
    """This rank's Stage, checked against the layers megatron-core built (layer_number is 1-based, global)."""
    built = tuple(layer.layer_number - 1 for layer in model.decoder.layers)
    want = tuple(stage_ranges(n_layers, pp)[pp_rank])
    if built != want:
        raise RuntimeError(f"pipeline stage {pp_rank}: megatron-core built layers {built}, expected {want}")
    return Stage(built, first=pp_rank == 0, last=pp_rank == pp - 1)


def micro_batches(batch: dict, n: int, tp: int) -> list[dict]:
    """The batch's rows in `n` micro-batches (at most one per row), each with its 4-D mask, its positions, T padded
    to a multiple of TP (sequence parallelism) and its loss weight (share of the loss tokens)."""
    from learner.backends.megatron.model import attention_mask_4d, position_ids

    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    t, extra = ids.shape[1], -ids.shape[1] % tp
    rows = torch.arange(ids.shape[0]).tensor_split(min(n, ids.shape[0]))
    lm = batch.get("loss_mask")
    total = float(lm.sum()) if lm is not None else float(ids.shape[0])
    out = []
    for r in rows:
        mb = {k: v[r] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == ids.shape[0] else v
              for k, v in batch.items()}
        mb["attention_mask"] = mask[r]
        pad_ids, pad_mask = F.pad(ids[r], (0, extra)), F.pad(mask[r], (0, extra))
        mb.update(t=t, padded_ids=pad_ids, positions=position_ids(pad_mask), mask4d=attention_mask_4d(pad_mask),
                  weight=(float(lm[r].sum()) / total if total else 0.0) if lm is not None else len(r) / total)
        out.append(mb)
    return out


LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def run(model, mbs: list[dict], loss_fn: LossFn | None, forward_only: bool, values: bool = False) -> list[dict]:
    """One pass over `mbs` through the 1F1B schedule; on the last stage a list of per-micro-batch dicts
    {"logp" ([b, T], detached; "values" for the critic, `values=True`), "stats": the loss's stats}, elsewhere [].
    The loss takes the log-probs (the critic: the values, 0 at padding) and the micro-batch, with its "logits"
    ([b, T, V] fp32, in the graph) added. Gradients accumulate on every stage's parameters (the caller zeroes and
    reduces them)."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from learner.models.scoring import logprobs_from_logits

    n = len(mbs)

    def step(data_iterator, gpt):
        mb = next(data_iterator)
        out = gpt(mb["padded_ids"], mb["positions"], mb["mask4d"])

        def loss_func(output):
            output = output.float()[:, :mb["t"]]
            mask = mb["attention_mask"].bool()
            key, x = ("values", torch.where(mask, output, torch.zeros_like(output))) if values else (
                "logp", logprobs_from_logits(output, mb["input_ids"], mb["attention_mask"], mb.get("temperature")))
            if loss_fn is None:
                return output.sum() * 0.0, {key: x.detach(), "logits": output.detach()}
            loss, stats = loss_fn(x, {**mb, "logits": output})
            # the schedule divides by the number of micro-batches: the sum is sum_m weight_m * loss_m
            return loss * (mb["weight"] * n), {key: x.detach(), "stats": stats, "weight": mb["weight"]}

        return out, loss_func

    seq = mbs[0]["padded_ids"].shape[1]
    rows = max(mb["padded_ids"].shape[0] for mb in mbs)
    if any(mb["padded_ids"].shape[0] != rows for mb in mbs):
        raise ValueError("pipeline micro-batches must have the same number of rows (the p2p shapes are fixed)")
    return forward_backward_pipelining_without_interleaving(
        forward_step_func=step, data_iterator=iter(mbs), model=[model], num_microbatches=n,
        seq_length=seq, micro_batch_size=rows, forward_only=forward_only)


def train(model, batch: dict, n: int, tp: int, loss_fn: LossFn, loss_scale: float = 1.0,
          values: bool = False) -> dict[str, float]:
    """Forward and backward of `loss_scale * loss_fn` over `batch` in `n` micro-batches; the loss's float stats
    (weighted like the loss) on the last stage, {} elsewhere."""
    def scaled(logp, b):
        loss, stats = loss_fn(logp, b)
        return loss * loss_scale, stats

    res = run(model, micro_batches(batch, n, tp), scaled, forward_only=False, values=values)
    keys = [k for k, v in (res[0]["stats"] if res else {}).items() if isinstance(v, (int, float)) or
            (torch.is_tensor(v) and v.numel() == 1)]
    return {k: sum(float(r["stats"][k]) * r["weight"] for r in res) for k in keys}


def gather_stages(local: dict[str, torch.Tensor], hf_cfg, dtype: torch.dtype,
                  template=None) -> dict[str, torch.Tensor]:
    """The whole HF state dict on every stage from each stage's own part (a collective over the pipeline group:
    one broadcast per HF tensor from the stage that holds it, in name order; shapes from the HF model on the meta
    device, `template(hf_cfg)` or the causal LM's; GLM's router bias stays fp32, the rest travels in `dtype`)."""
    from megatron.core import parallel_state as ps
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return local
    group, me = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    template = template or MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_cfg)]
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in template(hf_cfg).state_dict().items()}
    owners = _owners(shapes, hf_cfg, pp)
    out = {}
    for name in sorted(shapes):
        s = owners[name]
        t = (local[name].contiguous() if s == me else
             torch.empty(shapes[name], dtype=torch.float32 if name.endswith("e_score_correction_bias") else dtype))
        dist.broadcast(t, src=dist.get_global_rank(group, s), group=group)
        out[name] = t
    return out


def _owners(names, hf_cfg, pp: int) -> dict[str, int]:
    """The pipeline stage holding each HF tensor: its layer's stage; the embedding (and a tied lm_head) the first,
    the final norm and an untied lm_head the last."""
    stage_of_layer = {i: s for s, r in enumerate(stage_ranges(hf_cfg.num_hidden_layers, pp)) for i in r}
    out = {}
    for name in names:
        if ".layers." in name:
            out[name] = stage_of_layer[int(name.split(".layers.")[1].split(".")[0])]
        elif "embed_tokens" in name or (name == "lm_head.weight" and hf_cfg.tie_word_embeddings):
            out[name] = 0
        else:
            out[name] = pp - 1
    return out


def forward(model, input_ids: torch.Tensor, mask: torch.Tensor, tp: int, temperature=None,
            values: bool = False, key: str = "") -> torch.Tensor:
    """[B, T] log-probs (the critic: values; `key` "logits": the policy's [B, T, V] logits) through the schedule
    without a graph, on every stage of the pipeline."""
    mbs = micro_batches({"input_ids": input_ids, "attention_mask": mask, "temperature": temperature}, 1, tp)
    with torch.no_grad():
        res = run(model, mbs, None, forward_only=True, values=values)
    key = key or ("values" if values else "logp")
    shape = (*input_ids.shape, *([model.vocab_size] if key == "logits" else []))
    return broadcast_from_last(res[0][key] if res else None, shape, torch.float32)


def share_stats(stats: dict[str, float] | None) -> dict[str, float]:
    """The last stage's `stats` on every stage of this rank's pipeline (JSON in a uint8 tensor, never pickled)."""
    import json

    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stats or {}
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    payload = json.dumps(stats).encode() if last else b""
    group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    n = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if last else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(bytes(buf.numpy()).decode())


def broadcast_from_last(x: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`x` (held by the last pipeline stage) on every stage of this rank's pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return x
    buf = x.contiguous() if ps.is_pipeline_last_stage(ignore_virtual=True) else torch.empty(shape, dtype=dtype)
    dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return buf

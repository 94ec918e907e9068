"""AdamW state in HF naming and shapes, so a megatron checkpoint resumes at another layout (TP, EP, PP, DP, world
size, sharded optimizer or not).

The weights already leave in HF format (`MegatronLearner.policy_state_dict`). The moments go the same way: AdamW is
elementwise, so `exp_avg` and `exp_avg_sq` are tensors named and shaped as the parameters, and the converter's
slices, concatenations and renames (convert.py, tp.py, the expert and stage gathers) apply to them unchanged. Saving
(`export`, a collective like the weights' export): each rank's moments, whole over the data-parallel ranks (ZeRO:
the slices all-gathered), become one HF-named dict per moment; the leader writes it once
(`optim_<model>.hf.safetensors`, keys `<HF name>/<moment>`, with `optim_<model>.hf.json`: step and the AdamW
hyperparameters). Loading (`load`): each rank reads only the HF tensors its layout needs (safetensors opened lazily)
and cuts them as it cuts the weights; with a sharded optimizer it keeps its slice. Every step of the way is a slice
or a concatenation, so the moments come back bit-identical at any layout.

Checkpoints are now written by shard (`ckpt_shards.py`: each rank its part of the weights and of each moment, named
as here, through `whole_moments` and `load_from`); `export` and `load` keep the one-file format of the checkpoints
written before that, which still resume.

What a checkpoint does not hold here: momenta of tensors without gradients (GLM's router bias is a buffer: zeros,
ignored on load; a parameter a stage never uses, as the critic's head off the last pipeline stage: zeros). The step
count is one number per optimizer: every parameter with a gradient steps every time (gradients are all-reduced);
different counts are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from learner.backends.megatron import convert, tp
from learner.backends.megatron.model import mapped_tensors

MOMENTS = ("exp_avg", "exp_avg_sq")
_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def _module_opt(lrn, name: str):
    return (lrn.policy, lrn.opt) if name == "policy" else (lrn.value, lrn.value_opt)


def _names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _step_of(states: list[dict], what: str) -> int:
    steps = {float(s["step"]) for s in states if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"{what}: AdamW step counts differ between parameters ({sorted(steps)}); the layout-free "
                         "checkpoint keeps one")
    return int(steps.pop()) if steps else 0


def local_moments(module: torch.nn.Module, opt) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """({moment: {megatron name: this rank's tensor, whole over data parallelism}}, step); empty before a step."""
    names = _names(module)
    out: dict[str, dict[str, torch.Tensor]] = {m: {} for m in MOMENTS}
    if hasattr(opt, "buckets"):  # zero.ShardedAdamW: one state per bucket, this rank's slice
        masters = opt.param_groups[0]["params"]
        step = _step_of([opt.state.get(m, {}) for m in masters], "optimizer")
        if step == 0:
            return out, 0
        for b, master in zip(opt.buckets, masters):
            for mom in MOMENTS:
                mine = opt.state[master][mom].contiguous()
                parts = [mine]
                if b.size > 1:
                    parts = [torch.empty_like(mine) for _ in range(b.size)]
                    dist.all_gather(parts, mine, group=b.group)
                flat = torch.cat(parts)
                for p, off in zip(b.params, b.offsets):
                    out[mom][names[id(p)]] = flat[off:off + p.numel()].view_as(p)
        return out, step
    params = opt.param_groups[0]["params"]
    step = _step_of([opt.state.get(p, {}) for p in params], "optimizer")
    if step == 0:
        return out, 0
    for p in params:  # no state: never had a gradient (the critic's head off the last pipeline stage): zeros
        for mom in MOMENTS:
            out[mom][names[id(p)]] = opt.state[p][mom] if opt.state.get(p) else torch.zeros_like(p)
    return out, step


def meta_of(opt, step: int) -> dict:
    """What a layout-free checkpoint keeps of an AdamW beside its moments: its step and settings."""
    group = {k: list(v) if isinstance(v, tuple) else v for k, v in opt.param_groups[0].items() if k in _HPARAMS}
    return {"step": step, "param_group": group, "layout_free": True}


def whole_moments(module, opt) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """`local_moments` with every mapped tensor present (zeros for buffers and never-updated parameters)."""
    moments, step = local_moments(module, opt)
    return {mom: {n: moments[mom].get(n, torch.zeros_like(t)) for n, t in mapped_tensors(module).items()}
            for mom in MOMENTS}, step


def export(lrn, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors `<HF name>/<moment>`, meta) of "policy" or "value"'s AdamW: a collective over every rank."""
    module, opt = _module_opt(lrn, name)
    moments, step = whole_moments(module, opt)
    meta = meta_of(opt, step)
    if step == 0:
        return {}, meta
    hf_of = lrn.policy_state_dict if name == "policy" else lrn.value_state_dict
    tensors = {}
    for mom in MOMENTS:
        hf = hf_of(moments[mom])
        if name == "policy" and lrn.hf_config.tie_word_embeddings:
            hf.pop("lm_head.weight", None)  # the embedding's, shared
        tensors.update({f"{k}/{mom}": v.contiguous() for k, v in hf.items()})
    return tensors, meta


class _Lazy(Mapping):
    """HF name -> one moment's tensor, read from the open safetensors file only when asked for."""

    def __init__(self, f, keys: set[str], mom: str) -> None:
        self.f, self.keys_, self.mom = f, keys, mom

    def __getitem__(self, k: str) -> torch.Tensor:
        if f"{k}/{self.mom}" not in self.keys_:
            raise KeyError(k)
        return self.f.get_tensor(f"{k}/{self.mom}")

    def __contains__(self, k) -> bool:
        return f"{k}/{self.mom}" in self.keys_

    def __iter__(self):
        return (k.rsplit("/", 1)[0] for k in self.keys_ if k.endswith("/" + self.mom))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _to_megatron(lrn, name: str, hf: Mapping) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors (its experts, TP slices, stage) from HF-named ones, as the weights are cut."""
    cfg, lay = lrn.hf_config, lrn.layout
    if name == "policy":
        return tp.shard_state(convert.hf_to_megatron(hf, cfg, lrn.ep_rank, lrn.ep_size, stage=lrn.stage), lay)
    out = {f"backbone.{k}": v for k, v in tp.shard_state(convert.hf_to_megatron(
        hf, cfg, lrn.ep_rank, lrn.ep_size, prefix="backbone.", with_output=False, stage=lrn.value_stage), lay).items()}
    out.update({"value_head.norm.weight": hf["backbone.norm.weight"], "value_head.head.weight": hf["head.weight"],
                "value_head.head.bias": hf["head.bias"]})
    return out


def load(lrn, name: str, file: Path, meta: dict) -> None:
    """Set "policy" or "value"'s AdamW state from a layout-free file (`export`'s), cut for this rank's layout."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        load_from(lrn, name, {mom: _Lazy(f, keys, mom) for mom in MOMENTS}, meta)


def load_from(lrn, name: str, sources: dict[str, Mapping], meta: dict) -> None:
    """Set "policy" or "value"'s AdamW state from HF-named moments (`sources[moment]`, read as asked for)."""
    module, opt = _module_opt(lrn, name)
    for g in opt.param_groups:
        g.update({k: tuple(v) if isinstance(v, list) else v for k, v in meta["param_group"].items()})
    opt.state.clear()
    step = int(meta["step"])
    if step == 0:
        return
    moments = {mom: _to_megatron(lrn, name, sources[mom]) for mom in MOMENTS}
    names = _names(module)
    scalar = torch.tensor(float(step), dtype=torch.float32)
    if hasattr(opt, "buckets"):
        for b, master in zip(opt.buckets, opt.param_groups[0]["params"]):
            st = {"step": scalar.clone()}
            for mom in MOMENTS:
                flat = torch.zeros_like(b.flat)
                for p, off in zip(b.params, b.offsets):
                    flat[off:off + p.numel()] = moments[mom][names[id(p)]].reshape(-1)
                st[mom] = flat[b.rank * b.per:(b.rank + 1) * b.per].clone()
            opt.state[master] = st
        return
    # the critic's head off the last pipeline stage never has a gradient: no state, as in the run that saved
    idle = name == "value" and not lrn.value_stage.last
    for p in opt.param_groups[0]["params"]:
        n = names[id(p)]
        if not (idle and n.startswith("value_head.")):
            opt.state[p] = {"step": scalar.clone(), **{m: moments[m][n].to(p.dtype).clone().view_as(p)
                                                       for m in MOMENTS}}

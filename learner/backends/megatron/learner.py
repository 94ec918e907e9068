"""The megatron learner: policy (and critic) as megatron GPTModels, one optimizer step per call.

Each rank of a torchrun/Ray job builds one `MegatronLearner` from the same HF-format weights and
feeds it its data-parallel replica's share of the batch; experts are split over `expert_parallel`
ranks, matrices over `tensor_parallel` (tp.py), layers over `pipeline_parallel` stages (pipeline.py:
policy_step, value_step, forward_logprobs and values then run megatron-core's 1F1B schedule), AdamW
state over data-parallel ranks with `shard_optimizer` (zero.py). `sao learn --backend megatron` drives
its models with the trainer's own step code through `megatron_backend` (not at PP > 1); its own API is:

    lrn = make_megatron_learner(cfg, policy, value, MegatronOptions(expert_parallel=2))
    logp = lrn.forward_logprobs(ids, attn)                # [B, T], grad-enabled
    v = lrn.values(ids, attn)                            # [B, T]
    stats = lrn.policy_step(batch)                       # SAO/PPO/... loss, all-reduce, clip, AdamW
    stats = lrn.value_step(batch)                        # clipped value loss on the critic
    sd = lrn.policy_state_dict()                         # full HF state dict (collective)
    part = lrn.policy_shard()                            # this rank's part, to publish by shard

`batch` keys: input_ids, attention_mask [B, T]; old_logp, advantages, loss_mask [B, T] and
optionally temperature [B] (the sampling temperature to score at, default 1) for the policy;
old_values, returns, loss_mask for the critic. Alignment as learner.models.scoring:
column t belongs to token t (values: V of the prefix ending at t; the trainer's one-token shift
is the caller's). The objective is the mean over the W ranks of each rank's loss; when ranks hold
different token counts, pass loss_scale = W * local_tokens / global_tokens to get the global
token mean instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from learner.backends.megatron import convert, grads, parallel, pipeline, tp
from learner.backends.megatron.backend import MegatronBackend, check_expert_parallel
from learner.backends.megatron.model import (
    MegatronValueModel,
    build_gpt,
    mapped_tensors,
    megatron_logits,
    megatron_params,
    num_experts,
    run,
)

PolicyLossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


@dataclass
class MegatronOptions:
    expert_parallel: int = 1  # ranks that split the experts (must divide world size and num_experts)
    dtype: str = "float32"  # "bfloat16" on GPUs (pure bf16 weights; the parity tests use float32)
    tensor_parallel: int = 1  # ranks that split each matrix (megatron-core TP, with sequence parallelism)
    pipeline_parallel: int = 1  # pipeline stages (megatron-core PP)
    expert_tensor_parallel: int = 1  # ranks that split each expert's matrices (1: whole experts)
    micro_batches: int = 1  # pipeline_parallel > 1: micro-batches per step (exact for token-mean losses)
    shard_optimizer: bool = False  # AdamW state sharded over the data-parallel ranks (zero.ShardedAdamW)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"MegatronOptions.dtype={self.dtype!r}: use one of {', '.join(_DTYPES)}")
        for name in ("expert_parallel", "tensor_parallel", "pipeline_parallel", "expert_tensor_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"MegatronOptions.{name}={getattr(self, name)} must be >= 1")

    def sizes(self) -> tuple[int, int, int, int]:
        """(EP, TP, PP, ETP) as `parallel.init` and `parallel.check_layout` take them after the world size."""
        return self.expert_parallel, self.tensor_parallel, self.pipeline_parallel, self.expert_tensor_parallel


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class OptimSettings:
    lr: float = 3e-4
    value_lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 1.0


class MegatronLearner:
    def __init__(self, hf_policy, hf_value=None, options: MegatronOptions | None = None,
                 optim: OptimSettings | None = None, policy_loss: PolicyLossFn | None = None,
                 value_loss_fn: Callable | None = None, seed: int = 0):
        self.options = options or MegatronOptions()
        self.optim_cfg = optim or OptimSettings()
        ep, tp_, pp, etp = self.options.sizes()
        if not dist.is_initialized() or not _layout_matches(self.options):
            parallel.init(ep, seed, tp_, pp, etp)
        self.hf_config = hf_policy.config
        self.ep_rank, self.ep_size = parallel.ep_rank_size()
        self.layout = parallel.layout()
        self.device = parallel.device()
        dtype = _DTYPES[self.options.dtype]
        self.policy = build_gpt(self.hf_config, dtype=dtype).to(self.device)
        self.stage = pipeline.stage_of(self.policy, self.hf_config.num_hidden_layers, pp, self.layout["pp_rank"])
        self.load_hf_policy(hf_policy)
        self.policy_loss = policy_loss
        self.opt = _adamw(self.policy, self.optim_cfg.lr, self.optim_cfg, self.options.shard_optimizer)
        self.value = None
        self.value_loss_fn = value_loss_fn
        if hf_value is not None:
            self.value = MegatronValueModel(hf_value.config, dtype).to(self.device)
            self.value_stage = pipeline.stage_of(self.value.backbone, self.hf_config.num_hidden_layers, pp,
                                                 self.layout["pp_rank"])
            self.load_hf_value(hf_value)
            self.value_opt = _adamw(self.value, self.optim_cfg.value_lr, self.optim_cfg, self.options.shard_optimizer)

    # ---- forward passes
    def forward_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         temperature: torch.Tensor | float | None = None):
        """[B, T] log-probs at the sampling `temperature` (a float or [B]; None: 1), as scoring's."""
        from learner.models.scoring import logprobs_from_logits

        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        if self.layout["pp"] > 1:  # through the schedule, no graph kept: every stage gets the last stage's values
            return pipeline.forward(self.policy, input_ids, mask, self.layout["tp"], temperature)
        return logprobs_from_logits(megatron_logits(self.policy, input_ids, mask), input_ids, mask, temperature)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        if self.value is None:
            raise RuntimeError("MegatronLearner.values: built without a value model (pass hf_value)")
        input_ids = input_ids.to(self.device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device)
        if self.layout["pp"] > 1:  # as forward_logprobs: no graph
            return pipeline.forward(self.value, input_ids, mask, self.layout["tp"], values=True)
        v = run(self.value, input_ids, mask)
        return torch.where(mask.bool(), v, torch.zeros_like(v))  # 0 at padding, as scoring.values

    # ---- optimizer steps
    def policy_step(self, batch: dict, loss_scale: float = 1.0) -> dict[str, float]:
        if self.policy_loss is None:
            raise RuntimeError("MegatronLearner.policy_step: no policy loss given")
        self.policy.train()
        self.opt.zero_grad(set_to_none=True)
        batch = _to(batch, self.device)
        if self.layout["pp"] > 1:  # the loss's stats on the last stage only; grad_norm on every stage
            stats = pipeline.train(self.policy, batch, self.options.micro_batches, self.layout["tp"],
                                   self.policy_loss, loss_scale)
            return {**stats, **_reduce_and_step(self.policy, self.opt, self.optim_cfg.grad_clip)}
        logp = self.forward_logprobs(batch["input_ids"], batch.get("attention_mask"), batch.get("temperature"))
        loss, stats = self.policy_loss(logp, batch)
        (loss * loss_scale).backward()
        return {**stats, **_reduce_and_step(self.policy, self.opt, self.optim_cfg.grad_clip)}

    def value_step(self, batch: dict, loss_scale: float = 1.0) -> dict[str, float]:
        if self.value is None or self.value_loss_fn is None:
            raise RuntimeError("MegatronLearner.value_step: needs hf_value and value_loss_fn")
        self.value.train()
        self.value_opt.zero_grad(set_to_none=True)
        batch = _to(batch, self.device)
        if self.layout["pp"] > 1:
            stats = pipeline.train(self.value, batch, self.options.micro_batches, self.layout["tp"],
                                   self.value_loss_fn, loss_scale, values=True)
            return {**stats, **_reduce_and_step(self.value, self.value_opt, self.optim_cfg.grad_clip)}
        v = self.values(batch["input_ids"], batch.get("attention_mask"))
        loss, stats = self.value_loss_fn(v, batch)
        (loss * loss_scale).backward()
        return {**stats, **_reduce_and_step(self.value, self.value_opt, self.optim_cfg.grad_clip)}

    # ---- weights out
    def policy_state_dict(self, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The full HF-format policy state dict on every rank (a collective over the EP group); `tensors`: other
        tensors named and shaped as the policy's (its AdamW moments, reshard.py) instead of the weights."""
        from megatron.core import parallel_state as ps

        mine = tp.gather_state(megatron_params(self.policy) if tensors is None else tensors, self.layout)
        local = convert.megatron_to_hf(mine, self.hf_config, self.ep_rank, self.ep_size, stage=self.stage)
        full = convert.gather_experts(local, self.hf_config, ps.get_expert_model_parallel_group())
        return _cpu(pipeline.gather_stages(full, self.hf_config, _DTYPES[self.options.dtype]))

    def policy_shard(self):
        """This rank's own part of the HF policy, to publish by shard (`export.PolicyShard`: the whole tensors it
        owns among its stage's dense tensors and its experts; nothing on a data-parallel copy). A collective over
        the world (which ranks write)."""
        return self.shard_of("policy", megatron_params(self.policy))

    def shard_of(self, name: str, tensors: dict[str, torch.Tensor]):
        """This rank's part of "policy" or "value" in HF format, of its weights or of `tensors` named as them (its
        AdamW moments); a collective over the world."""
        from learner.backends.megatron.export import PolicyShard, is_writer, value_entries

        shard = parallel.writer_index(is_writer(self.layout))
        if name == "policy":
            return PolicyShard(tensors, self.hf_config, self.layout, self.stage, shard)
        entries = value_entries(self.hf_config, self.layout, self.value_stage)
        return PolicyShard(tensors, self.hf_config, self.layout, self.value_stage, shard, entries)

    def value_state_dict(self, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The full value model in H2's ValueModel layout (backbone.*, head.*); collective. `tensors`: as
        policy_state_dict's, named as the MegatronValueModel's (backbone.*, value_head.*)."""
        from megatron.core import parallel_state as ps

        if self.value is None:
            raise RuntimeError("MegatronLearner.value_state_dict: built without a value model")
        from learner.models.value import ValueModel

        t = megatron_params(self.value) if tensors is None else tensors
        backbone = tp.gather_state({k[9:]: v for k, v in t.items() if k.startswith("backbone.")}, self.layout)
        local = convert.megatron_to_hf(backbone, self.hf_config, self.ep_rank, self.ep_size, prefix="backbone.",
                                       with_output=False, stage=self.value_stage)
        local.pop("lm_head.weight", None)
        if self.value_stage.last:  # the head on other stages is never used
            local.update({"backbone.norm.weight": t["value_head.norm.weight"],
                          "head.weight": t["value_head.head.weight"], "head.bias": t["value_head.head.bias"]})
        full = convert.gather_experts(local, self.hf_config, ps.get_expert_model_parallel_group())
        return _cpu(pipeline.gather_stages(full, self.hf_config, _DTYPES[self.options.dtype], ValueModel))

    def full_params(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`module`'s megatron tensors whole over TP (this rank's experts): a collective over TP and expert TP."""
        return tp.gather_state(megatron_params(module), self.layout)

    def export_hf_policy(self):
        """A fresh HF causal LM of the policy's architecture holding the current weights (collective;
        every rank gets one; save it on rank 0 with learner.models.policy.save_policy)."""
        model = self.empty_hf_policy()
        model.load_state_dict(self.policy_state_dict(), strict=True)
        return model.float().eval()

    def empty_hf_policy(self):
        """An HF policy of this learner's architecture to load a checkpoint into (not collective)."""
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        return MODEL_FOR_CAUSAL_LM_MAPPING[type(self.hf_config)](self.hf_config).float()

    def empty_hf_value(self):
        from learner.models.value import ValueModel

        return ValueModel(self.hf_config).float()

    def load_hf_policy(self, hf_policy) -> None:
        """Replace the policy's weights with an HF model's (e.g. a checkpoint's); this rank's experts."""
        self.load_hf_tensors("policy", hf_policy.state_dict())

    def load_hf_value(self, hf_value) -> None:
        self.load_hf_tensors("value", hf_value.state_dict())

    def load_hf_tensors(self, name: str, hf_sd) -> None:
        """"policy" or "value"'s weights from HF-named tensors (a dict, or a mapping that reads only the tensors
        this rank asks for: its stage, experts and TP slices)."""
        if name == "policy":
            load_megatron(self.policy, tp.shard_state(convert.hf_to_megatron(
                hf_sd, self.hf_config, self.ep_rank, self.ep_size, stage=self.stage), self.layout))
        elif self.value is None:
            raise RuntimeError("MegatronLearner.load_hf_value: built without a value model")
        else:
            load_value(self.value, hf_sd, self.hf_config, self.ep_rank, self.ep_size, self.layout, self.value_stage)

    def export_hf_value(self):
        """H2's `ValueModel` holding the critic's current weights (collective)."""
        from learner.models.value import ValueModel

        vm = ValueModel(self.hf_config)
        vm.load_state_dict(self.value_state_dict(), strict=True)
        return vm.float().eval()


def megatron_backend(cfg, hf_policy, hf_value=None) -> MegatronBackend:
    """The backend of `sao learn --backend megatron` (cfg.backend: expert_parallel, dtype), every rank built from the
    same HF weights; joins the ranks' process group, so every rank must call it."""
    b = cfg.backend
    check_expert_parallel(b.expert_parallel, num_experts(hf_policy.config), cfg.io.init or "model")
    opts = MegatronOptions(b.expert_parallel, b.dtype, tensor_parallel=b.tensor_parallel,
                           pipeline_parallel=b.pipeline_parallel, shard_optimizer=b.shard_optimizer)
    return MegatronBackend(make_megatron_learner(cfg, hf_policy, hf_value, opts))


def megatron_trainer_models(cfg, hf_policy, hf_value=None, options: MegatronOptions | None = None):
    """(learner.trainer.step.Models over megatron, the MegatronLearner): the trainer's step code
    (prepare, update) runs on them unchanged, clipping through their MegatronBackend."""
    lrn = make_megatron_learner(cfg, hf_policy, hf_value, options)
    return MegatronBackend(lrn).models, lrn


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def _cpu(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in sd.items()}


def _layout_matches(o: MegatronOptions) -> bool:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return False
    lay = parallel.layout()
    return (lay["ep"], lay["tp"], lay["pp"], lay["etp"]) == o.sizes()


def _adamw(module: torch.nn.Module, lr: float, o: OptimSettings, shard: bool = False) -> torch.optim.Optimizer:
    if shard:
        from learner.backends.megatron.zero import ShardedAdamW

        return ShardedAdamW([(n, p) for n, p in module.named_parameters() if p.requires_grad], lr=lr,
                            betas=tuple(o.betas), weight_decay=o.weight_decay)
    # Unsharded: a plain torch optimizer (megatron's distributed/bf16 optimizers assert CUDA tensors); every
    # rank steps its own copy of the dense weights with identical all-reduced grads.
    return torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr,
                             betas=tuple(o.betas), weight_decay=o.weight_decay)


def _reduce_and_step(module, opt, grad_clip: float | None) -> dict[str, float]:
    norm = grads.reduce_and_clip(module, grad_clip)
    opt.step()
    return {"grad_norm": norm}


def load_megatron(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy `sd` into `module`'s parameters and persistent buffers; the two name sets must be equal."""
    params = mapped_tensors(module)
    missing, extra = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
    if missing or extra:
        raise KeyError(f"megatron load: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        for n, p in params.items():
            if p.shape != sd[n].shape:
                raise ValueError(f"megatron load: '{n}' has shape {tuple(p.shape)}, got {tuple(sd[n].shape)}")
            p.copy_(sd[n])


def load_value(vm: MegatronValueModel, hf_sd: dict[str, torch.Tensor], hf_cfg, ep_rank: int,
               ep_size: int, layout: dict[str, int], stage=None) -> None:
    """H2's ValueModel state dict (backbone.*, head.*) -> MegatronValueModel on this rank (of pipeline `stage`)."""
    load_megatron(vm.backbone, tp.shard_state(convert.hf_to_megatron(
        hf_sd, hf_cfg, ep_rank, ep_size, prefix="backbone.", with_output=False, stage=stage), layout))
    with torch.no_grad():
        vm.value_head.norm.weight.copy_(hf_sd["backbone.norm.weight"])
        vm.value_head.head.weight.copy_(hf_sd["head.weight"])
        vm.value_head.head.bias.copy_(hf_sd["head.bias"])


def make_megatron_learner(cfg, hf_policy, hf_value=None,
                          options: MegatronOptions | None = None) -> MegatronLearner:
    """A learner configured from `learner.config.LearnerConfig` (loss, optim, value, seed)."""
    from learner.algorithms import policy_loss, value_loss

    name, params = cfg.loss.name, cfg.loss.params()

    def pl(logp, b):
        return policy_loss(name, logp, b["old_logp"], b["advantages"], b["loss_mask"], **params)

    def vl(v, b):
        return value_loss(v, b["old_values"], b["returns"], b["loss_mask"],
                          clip=cfg.value.value_clip, agg=cfg.value.agg)

    o = cfg.optim
    optim = OptimSettings(lr=o.lr, value_lr=o.value_lr, weight_decay=o.weight_decay,
                          betas=tuple(o.betas), grad_clip=o.grad_clip)
    return MegatronLearner(hf_policy, hf_value, options, optim, pl, vl, seed=cfg.seed)

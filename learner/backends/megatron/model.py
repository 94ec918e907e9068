"""The policy and the value model as megatron-core GPTModels with MoE and expert parallelism.

Mapped HF architectures (transformers 4.57); `check_supported` names the field that is not mapped
and refuses every other architecture (Mixtral, Qwen2-MoE, DeepSeek-V3, ...) by its model_type:
  `Qwen3MoeForCausalLM`: every layer sparse (`decoder_sparse_step=1`, no `mlp_only_layers`), no
    shared experts, no attention bias, no sliding window, no rope scaling.
  `Glm4MoeForCausalLM`: the first `first_k_dense_replace` layers dense, then MoE layers with one
    ungated shared expert block; sigmoid router with a selection-only bias; `n_group = topk_group
    = 1` and `norm_topk_prob = True` only (see GLM-4-MoE below); no rope scaling.

Shared numerics and their megatron-core settings:
  RMSNorm(eps) on every norm incl. per-head q/k norms -> normalization="RMSNorm",
    layernorm_epsilon=eps, qk_layernorm (local spec: torch.nn.RMSNorm)
  rope (rotate-half, base theta) on the first int(head_dim * partial_rotary_factor) dims of each
    head, the rest passed through -> position_embedding_type="rope", rotary_base=theta,
    rotary_percent=partial_rotary_factor (Qwen3: 1.0), rotary_interleaved=False; megatron's
    inv_freq uses the same int() truncation and rotates t[..., :rot_dim] exactly as HF.
  SwiGLU MLPs (experts, shared experts, dense layers) -> gated_linear_unit=True, activation_func=
    silu (fc1 = [gate; up])
  router logits in fp32 (HF casts hidden and weight to fp32) -> moe_router_dtype="fp32"
  no load-balancing loss in the forward (aux loss 0, type "none"), dropless (no capacity).

Qwen3-MoE router: softmax -> top-k -> renormalise (norm_topk_prob=True) -> moe_router_score_function=
  "softmax", moe_router_pre_softmax=False: top-k on the logits then softmax over those k, which
  equals softmax over all experts renormalised over the chosen k (the partition function cancels).
  norm_topk_prob=False -> pre_softmax=True (softmax, top-k, no renormalisation).

GLM-4-MoE:
  dense layers i < first_k_dense_replace (width intermediate_size) -> moe_layer_freq=[0]*k + [1]*(L-k),
    ffn_hidden_size=intermediate_size; experts moe_ffn_hidden_size=moe_intermediate_size
  shared experts: one plain SwiGLU MLP of width n_shared_experts * moe_intermediate_size added to the
    routed output, no sigmoid gate (HF `Glm4MoeMLP`) -> moe_shared_expert_intermediate_size,
    moe_shared_expert_gate=False
  router: s = sigmoid(logits); experts chosen by top-k of s + e_score_correction_bias; weights
    s gathered WITHOUT the bias, / (sum + 1e-20), * routed_scaling_factor -> score_function=
    "sigmoid", moe_router_enable_expert_bias=True (buffer `router.expert_bias`, fp32, used for
    selection only: megatron gathers the unbiased scores too), moe_router_topk_scaling_factor.
    Megatron never updates the bias in the forward (only Megatron-LM's training loop does, from
    `local_tokens_per_expert`); this backend does not either, as HF.
  attention_bias -> add_qkv_bias=True (linear_qkv.bias in the weight's per-group layout);
    o_proj has no bias in HF (add_bias_linear=False)
  use_qk_norm -> qk_layernorm; tie_word_embeddings -> share_embeddings_and_output_weights
  Refused, because megatron-core 0.16 computes them differently:
    n_group/topk_group != 1: HF scores a group by its top-2 experts and masks the other groups
      with 0.0; megatron uses the top-(k / topk_group) and -inf (differs once score + bias < 0).
    norm_topk_prob=False: megatron's sigmoid router always renormalises for k > 1.
    num_experts_per_tok=1: megatron's sigmoid router skips the renormalisation for k = 1 (weight
      s instead of HF's s / s = 1).
    n_shared_experts=0: HF still builds a zero-width shared MLP (no megatron counterpart).
The value model is the same backbone built with post_process=False (no final norm, no output
layer) plus `ValueHead`: final RMSNorm (HF `model.norm`) and a scalar linear head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from learner.backends.megatron import cpu_compat, parallel


def _qwen3_moe_refusals(c) -> dict[str, bool]:
    return {
        "attention_bias": bool(getattr(c, "attention_bias", False)),
        "use_sliding_window": bool(getattr(c, "use_sliding_window", False)),
        "rope_scaling": getattr(c, "rope_scaling", None) not in (None, {}),
        "mlp_only_layers": bool(getattr(c, "mlp_only_layers", None)),
        "decoder_sparse_step": getattr(c, "decoder_sparse_step", 1) != 1,
        "hidden_act": getattr(c, "hidden_act", "silu") != "silu",
    }


def _glm4_moe_refusals(c) -> dict[str, bool]:
    return {
        "rope_scaling": getattr(c, "rope_scaling", None) not in (None, {}),
        "hidden_act": getattr(c, "hidden_act", "silu") != "silu",
        "n_group": getattr(c, "n_group", 1) != 1,
        "topk_group": getattr(c, "topk_group", 1) != 1,
        "norm_topk_prob": not c.norm_topk_prob,
        "num_experts_per_tok": c.num_experts_per_tok < 2,
        "n_shared_experts": c.n_shared_experts < 1,
    }


_REFUSALS = {"qwen3_moe": _qwen3_moe_refusals, "glm4_moe": _glm4_moe_refusals}


def check_supported(hf_cfg) -> None:
    """Raise ValueError naming the model_type or the first HF config field this backend does not map."""
    arch = getattr(hf_cfg, "model_type", None)
    if arch not in _REFUSALS:
        raise ValueError(f"megatron backend: model_type '{arch}' is not mapped (only {', '.join(_REFUSALS)})")
    for field, is_bad in _REFUSALS[arch](hf_cfg).items():
        if is_bad:
            raise ValueError(f"megatron backend: {arch} config field '{field}' = "
                             f"{getattr(hf_cfg, field)!r} is not supported")
    if arch == "qwen3_moe" and hf_cfg.num_experts_per_tok == 1 and hf_cfg.norm_topk_prob:
        # HF: gate weight 1.0; megatron refuses top-1 without pre-softmax (which would give p_max)
        raise ValueError("megatron backend: num_experts_per_tok = 1 with norm_topk_prob = True is not "
                         "supported (megatron-core refuses top-1 routing after the softmax); use >= 2 experts "
                         "per token")


def is_glm4_moe(hf_cfg) -> bool:
    return hf_cfg.model_type == "glm4_moe"


def num_experts(hf_cfg) -> int:
    """Routed experts per MoE layer (Qwen3: num_experts, GLM-4: n_routed_experts)."""
    return hf_cfg.n_routed_experts if is_glm4_moe(hf_cfg) else hf_cfg.num_experts


def moe_layer_pattern(hf_cfg) -> list[int]:
    """1 for an MoE layer, 0 for a dense one (megatron's moe_layer_freq list)."""
    first_moe = hf_cfg.first_k_dense_replace if is_glm4_moe(hf_cfg) else 0
    return [int(i >= first_moe) for i in range(hf_cfg.num_hidden_layers)]


def qk_norm(hf_cfg) -> bool:
    return bool(hf_cfg.use_qk_norm) if is_glm4_moe(hf_cfg) else True


def qkv_bias(hf_cfg) -> bool:
    return bool(getattr(hf_cfg, "attention_bias", False))


def head_dim(hf_cfg) -> int:
    return getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads


def _router_settings(hf_cfg) -> dict:
    if is_glm4_moe(hf_cfg):
        return {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "moe_router_topk_scaling_factor": float(hf_cfg.routed_scaling_factor),
                "moe_shared_expert_intermediate_size": hf_cfg.n_shared_experts * hf_cfg.moe_intermediate_size,
                "moe_shared_expert_gate": False}
    return {"moe_router_score_function": "softmax", "moe_router_pre_softmax": not hf_cfg.norm_topk_prob}


def transformer_config(hf_cfg, dtype: torch.dtype = torch.float32):
    """The megatron TransformerConfig equivalent to a mapped HF config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_supported(hf_cfg)
    from megatron.core import parallel_state as ps

    return TransformerConfig(
        num_layers=hf_cfg.num_hidden_layers,
        hidden_size=hf_cfg.hidden_size,
        num_attention_heads=hf_cfg.num_attention_heads,
        num_query_groups=hf_cfg.num_key_value_heads,
        kv_channels=head_dim(hf_cfg),
        # dense layers' width (Qwen3 has none: every layer is MoE)
        ffn_hidden_size=hf_cfg.intermediate_size if is_glm4_moe(hf_cfg) else hf_cfg.moe_intermediate_size,
        moe_ffn_hidden_size=hf_cfg.moe_intermediate_size,
        num_moe_experts=num_experts(hf_cfg),
        moe_layer_freq=moe_layer_pattern(hf_cfg),
        moe_router_topk=hf_cfg.num_experts_per_tok,
        **_router_settings(hf_cfg),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",  # HF computes the router logits and scores in fp32
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        # megatron-core refuses MoE training at TP > 1 without it (MoELayer.forward)
        sequence_parallel=ps.get_tensor_model_parallel_world_size() > 1,
        pipeline_dtype=dtype,
        batch_p2p_comm=not cpu_compat.needed(),  # batched p2p is followed by torch.cuda.synchronize()
        **parallel.config_settings(hf_cfg.num_hidden_layers, ps.get_pipeline_model_parallel_world_size()),
        normalization="RMSNorm",
        layernorm_epsilon=hf_cfg.rms_norm_eps,
        qk_layernorm=qk_norm(hf_cfg),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf_cfg),
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_cfg, "attention_dropout", 0.0)),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_compat.needed(),
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        init_method_std=getattr(hf_cfg, "initializer_range", 0.02),
    )


def build_gpt(hf_cfg, post_process: bool = True, dtype: torch.dtype = torch.float32):
    """A megatron GPTModel for `hf_cfg` on this rank (holding its EP share of the experts).

    `post_process=False` drops the final norm and output layer: the value model's backbone."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cpu_compat.apply()
    cfg = transformer_config(hf_cfg, dtype)
    check_tensor_parallel(hf_cfg, cfg.tensor_model_parallel_size, cfg.expert_tensor_parallel_size)
    # per-layer local specs (dense or MoE) from cfg.moe_layer_freq, this pipeline stage's layers only
    spec = _sp_norms(get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"))
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=hf_cfg.vocab_size,
        max_sequence_length=hf_cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=True),
        post_process=post_process and ps.is_pipeline_last_stage(ignore_virtual=True),
        parallel_output=False,  # full-vocab logits on every TP rank (the losses take log-softmax over them)
        # the critic's backbone has no output layer to tie (at PP > 1 megatron would sync a copy it never builds)
        share_embeddings_and_output_weights=bool(hf_cfg.tie_word_embeddings) and post_process,
        position_embedding_type="rope",
        rotary_percent=float(getattr(hf_cfg, "partial_rotary_factor", 1.0)),
        rotary_base=hf_cfg.rope_theta,  # float: no truncation of e.g. 1e6 or 5e5
    )
    # Megatron-LM casts through Float16Module; the local spec's torch norms are built in fp32.
    return _expert_bias_fp32(model.to(dtype=dtype))


def check_tensor_parallel(hf_cfg, tp: int, etp: int) -> None:
    """ValueError naming the HF field that TP (or expert TP) does not divide."""
    fields = {"num_attention_heads": tp, "num_key_value_heads": tp, "vocab_size": tp,
              "moe_intermediate_size": etp, "intermediate_size": tp if is_glm4_moe(hf_cfg) else 1}
    for field, n in fields.items():
        if getattr(hf_cfg, field) % n:
            raise ValueError(f"megatron backend: tensor parallelism {n} does not divide {field} = "
                             f"{getattr(hf_cfg, field)}")


class SPRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm that megatron-core's local spec can use under sequence parallelism.

    megatron's WrappedTorchNorm refuses sequence_parallel only because it does not mark its weight: under
    SP each TP rank normalises its own sequence slice, so the weight's gradient is a partial sum that
    `grads.allreduce_grads` sums over TP (megatron's finalize_model_grads does the same for this attribute)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def _sp_norms(spec):
    """The block spec with every WrappedTorchNorm replaced by SPRMSNorm (same math, SP-aware)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SPRMSNorm
    if isinstance(spec, list):
        return [_sp_norms(s) for s in spec]
    if isinstance(spec, ModuleSpec):
        spec.module = _sp_norms(spec.module)
        spec.submodules = _sp_norms(spec.submodules)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            setattr(spec, f.name, _sp_norms(getattr(spec, f.name)))
    return spec


def _expert_bias_fp32(model):
    # The cast above also casts the router's expert_bias buffer; megatron keeps it fp32 (as HF keeps
    # e_score_correction_bias), so loading an fp32 bias into a bf16 model must not round it.
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            buf.data = buf.data.float()
    return model


def positions(input_ids: torch.Tensor) -> torch.Tensor:
    b, t = input_ids.shape
    return torch.arange(t, device=input_ids.device).unsqueeze(0).expand(b, t)


def attention_mask_4d(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 1 = real token -> megatron's [B, 1, T, T] bool, True = may NOT attend.

    Causal and key padding together, so either padding side works."""
    t = mask.shape[1]
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=mask.device), diagonal=1)
    return causal[None, None] | ~mask.bool()[:, None, None, :]


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # as learner.models.scoring


def run(model, input_ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """`model(ids, positions, 4d mask)` as fp32 [B, T, ...]. Under sequence parallelism the sequence is
    split over the TP ranks: T is right-padded to a multiple of TP (masked, after every real token, so no
    real token sees it) and the padding cut off the output."""
    from megatron.core import parallel_state as ps

    pos = position_ids(mask) if pos is None else pos
    t = input_ids.shape[1]
    extra = -t % ps.get_tensor_model_parallel_world_size()
    if extra:
        input_ids, mask, pos = (F.pad(x, (0, extra)) for x in (input_ids, mask, pos))
    return model(input_ids, pos, attention_mask_4d(mask)).float()[:, :t]


def megatron_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """[B, T, V] fp32 logits of a megatron policy."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return run(model, input_ids, mask)


class ValueHead(torch.nn.Module):
    """Final RMSNorm + scalar head on top of the backbone's last hidden states."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.head = torch.nn.Linear(hidden, 1, bias=True, dtype=dtype)

    def forward(self, hidden_sbh: torch.Tensor) -> torch.Tensor:
        # [S, B, H] (megatron layout; under SP this rank's S / TP rows) -> [B, S]
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if ps.get_tensor_model_parallel_world_size() > 1:
            # every TP rank computes the head and the loss on the whole sequence: the backward only
            # takes this rank's slice (no sum over TP ranks)
            hidden_sbh = gather_from_sequence_parallel_region(hidden_sbh, tensor_parallel_output_grad=False)
        return self.head(self.norm(hidden_sbh)).squeeze(-1).transpose(0, 1)


class MegatronValueModel(torch.nn.Module):
    """Critic: GPT backbone (post_process=False) + ValueHead; `forward(ids, pos, mask) -> [B, T]`."""

    def __init__(self, hf_cfg, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.backbone = build_gpt(hf_cfg, post_process=False, dtype=dtype)
        self.value_head = ValueHead(hf_cfg.hidden_size, hf_cfg.rms_norm_eps, dtype)

    @property
    def config(self):  # megatron's schedules read the model's config and type
        return self.backbone.config

    @property
    def model_type(self):
        return self.backbone.model_type

    def set_input_tensor(self, t) -> None:  # pipeline stages after the first: the previous stage's hidden states
        self.backbone.set_input_tensor(t)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] values on the last pipeline stage (the only one without PP); elsewhere the hidden states to send."""
        from megatron.core import parallel_state as ps

        pos = positions(input_ids) if position_ids is None else position_ids
        hidden = self.backbone(input_ids, pos, attention_mask=attention_mask)
        return self.value_head(hidden) if ps.is_pipeline_last_stage(ignore_virtual=True) else hidden


def mapped_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the conversion maps: parameters plus persistent buffers (GLM's router `expert_bias`)."""
    saved = module.state_dict(keep_vars=True).keys()
    return {**dict(module.named_parameters()), **{n: b for n, b in module.named_buffers() if n in saved}}


def megatron_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach() for n, t in mapped_tensors(module).items()}

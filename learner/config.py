"""Typed configuration of the continuous learner (`sao learn`).

Build one with `streamer.wire.config.load_config(LearnerConfig, yaml_path, ["loss.name=ppo", ...])`;
`validate()` runs there and names the field and the fix. Section by section:
  loss       which policy loss (learner.algorithms.POLICY_LOSSES) and its clip parameters
  advantage  GAE with decoupled lambda (value model), a group estimator (GRPO family) or REINFORCE++'s batch one
  optim      learning rates and gradient clipping of the policy and the value model
  value      the critic: a copy of the backbone or a head on the policy's, warm-up, re-warm-up on a spike, clip
  policy     LoRA adapters instead of training every weight
  batch      token-budgeted batches, staleness, weight publication, sync mode
  checkpoint where and how often (model + optimizers + RNG + consumed offsets, together)
  backend    torch (one process) or megatron (megatron-core GPTModel, expert parallel, under torchrun)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from learner.algorithms import AGGS, KL_TYPES, NEEDS_GROUPS, POLICY_LOSSES
from learner.algorithms.shaping import OverlongConfig
from learner.models.config import ModelConfig
from learner.profiles import ProfileName
from streamer.wire.config import ConfigError
from streamer.wire.settings import PULLS, WEIGHTS_TRANSPORTS, WeightsTransport, parse_hostport

# Choice fields are Literal types (load_config refuses anything else and lists the choices); each equals the keys
# of the registry it selects from (tests/test_config.py checks it)
LossName = Literal["sao", "ppo", "dual_clip", "dapo", "gspo", "cispo", "decoupled_ppo"]  # algorithms.POLICY_LOSSES
Estimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"]  # gae, then algorithms.GROUP_ESTIMATORS
KLType = Literal["k1", "k3", "forward"]  # algorithms.KL_TYPES
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]  # algorithms.AGGS
BackendName = Literal["torch", "megatron"]
BackendDtype = Literal["float32", "bfloat16"]
Precision = Literal["float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]
ValueKind = Literal["copy", "head"]
LoraPublish = Literal["merged", "adapters"]
ESTIMATORS = get_args(Estimator)


@dataclass
class LossConfig:
    name: LossName = "sao"
    eps_low: float | None = None  # None: the algorithm's own default (0.2; GSPO 3e-4; CISPO 1.0)
    eps_high: float | None = None  # None: the algorithm's own default (0.2; DAPO/CISPO 0.28; GSPO 4e-4)
    clip_c: float = 3.0  # dual_clip only
    behav_cap: float = 5.0  # decoupled_ppo only: tokens with pi_prox/mu above it are dropped
    agg: Aggregation | None = None  # None: the loss's default
    # KL penalty to the frozen initial policy (io.init), verl's use_kl_loss: loss += kl_coef · agg(kl_type per
    # token). 0: off (no reference model is built). k1 = log pi - log ref; k3 = verl's low_var_kl; forward = the
    # exact KL(ref || pi) over the vocabulary (learner.algorithms.kl)
    # 0.1 by default: RL on a stationary stream sharpens the policy onto the concepts it is rewarded for, until a
    # drifted concept can no longer be sampled (no signal) and negative advantages push mass into garbage (the
    # lr-2e-4 collapse); the anchor keeps the warm start's alternatives alive (experiments/online.py, docs/results/)
    kl_coef: float = 0.1
    kl_type: KLType = "k3"

    def params(self) -> dict[str, float | str]:
        """Keyword parameters for `policy_loss(name, ...)`: only those this loss takes."""
        out: dict[str, float | str] = {}
        if self.eps_low is not None:
            out["eps_low"] = self.eps_low
        if self.eps_high is not None:
            out["eps_high"] = self.eps_high
        if self.agg is not None:
            out["agg"] = self.agg
        if self.name == "dual_clip":
            out["clip_c"] = self.clip_c
        if self.name == "decoupled_ppo":
            out["behav_cap"] = self.behav_cap
        return out


@dataclass
class AdvantageConfig:
    estimator: Estimator = "gae"  # gae (value model), grpo, dr_grpo, rloo (groups) or reinforce_pp (batch baseline)
    gamma: float = 1.0
    lam_actor: float = 0.95  # fixed actor lambda (ignored when adaptive_alpha is set)
    lam_critic: float = 1.0  # 1.0: Monte-Carlo targets for the critic
    adaptive_alpha: float | None = None  # e.g. 0.05: lambda_actor = 1 - 1/(alpha·L) per sequence
    batch_norm: bool = False  # whiten advantages over the batch (masked mean/std)
    group_size: int = 8  # algorithms.NEEDS_GROUPS: members per group (a batch waits for complete groups)
    dynamic_sampling: bool = False  # GRPO family: drop groups whose rewards are all equal (DAPO)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO's soft overlong punishment


@dataclass
class OptimConfig:
    # policy AdamW. 2e-4 with the KL anchor (loss.kl_coef): recovers 3 of the default scenario's 4 drifts within their
    # phase in experiments/online.py where 5e-5 recovered none; without the anchor 2e-4 sharpened the policy onto the
    # old concepts (parens 0.05 after the drift) and, with 2 updates per batch at staleness 2, collapsed (docs/results/)
    lr: float = 2e-4
    value_lr: float = 1e-3  # value-model AdamW
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0  # max global grad norm, each model separately
    updates_per_batch: int = 1  # gradient steps on each batch (>1: the clip band starts to bind)


@dataclass
class LoraSettings:
    # LoRA adapters on the policy (the `lora` extra: peft): only the adapters train and hold optimizer state; each
    # version is published as merged weights (base + B·A·alpha/r), which agents load as a full policy. 0: off
    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # adapters: versions hold the adapters alone, which agents merge onto the base model they were started with
    # (their --model must be the learner's io.init; a version made for another base is refused)
    publish: LoraPublish = "merged"


@dataclass
class PolicyConfig:
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class ValueConfig:
    # copy: a separate critic, the policy's backbone copied (its own weights and AdamW state); head: a linear head on
    # the policy's own backbone (no second backbone, no optimizer state but the head's)
    kind: ValueKind = "copy"
    # head: the value loss trains the head alone (true) or also the shared backbone, stepped by the policy's
    # optimizer with the policy loss's gradient (false; critic-only steps then train only the head)
    detach_backbone: bool = True
    # critic-only steps before the first policy update: the head starts at random, and advantages from it would
    # move the policy in random directions (the first policy step's loss was -0.54 without it)
    warmup_steps: int = 5
    # clipped value loss. The old values come from the same critic weights (`prepare` or the batch's first update's
    # forward): the clip binds only from a batch's second update (optim.updates_per_batch > 1); off by default
    value_clip: float | None = None
    agg: Aggregation = "token_mean"
    rewarm_steps: int = 2  # critic-only steps after a value-loss spike, e.g. a drift the critic has not seen
    spike_factor: float = 3.0  # a spike: value loss > spike_factor x its running mean
    spike_ema: float = 0.9  # decay of that running mean
    # the critic's depth: the first `layers` blocks of the policy's backbone (the critic costs about as much as the
    # policy per token; fewer blocks cost less and see less); None: all. Ignored with io.value_init
    layers: int | None = None


@dataclass
class BatchConfig:
    tokens: int = 4096  # token budget of a batch (prompt + response + observations)
    max_trajectories: int = 256  # a batch closes at this many trajectories, whatever its tokens
    micro_batch: int = 32  # trajectories per forward pass (gradients are accumulated)
    # > 0: micro-batches sized by tokens instead: rows (sorted by length) join one until rows x its longest row
    # would pass this many (a longer row goes alone), so long answers take fewer rows a pass; micro_batch then
    # does not bound them. The loss is the unsplit batch's whatever the split (each part weighted by its share). 0: off
    micro_tokens: int = 0
    max_staleness: int = 4  # drop trajectories more than this many versions behind the learner
    sync_every: int = 1  # publish weights (a new policy version) every this many steps (critic-only ones count)
    sync: bool = False  # synchronous mode: wait for `sync_batch` trajectories of the current version
    sync_batch: int = 64
    flush_at_end: bool = True  # when a finite source ends, train on the last partial batch
    # no trajectory for this long: train on the buffered ones as a partial batch (0: never). A liveness fallback for
    # paced agents waiting on a version while the learner waits on a batch; longer than any gap in a healthy run
    idle_flush_s: float = 30.0
    dedup_window: int = 100_000  # remember this many recent keys for de-duplication
    # a batch whose training raises (an exception, out of memory) this many times, across restarts, is dead-lettered
    # ("poison batch: <error>") instead of redone until the restarts are spent (learner.trainer.quarantine)
    poison_after: int = 2


@dataclass
class CheckpointConfig:
    dir: str = "runs/learner/checkpoints"
    every: int = 10  # checkpoint every this many steps (offsets are committed only with a checkpoint)
    keep: int = 2  # checkpoints kept on disk
    resume: bool = True  # resume from the latest checkpoint in `dir` if there is one
    # every checkpoint in `dir` damaged: move them into dir/damaged/ and start from zero (sao learn --from-scratch);
    # without it the learner stops, since a start from offset 0 would train every trajectory again
    from_scratch: bool = False


@dataclass
class IOConfig:
    trajectories: str = ""  # a recorded trajectory JSONL file to train from (no broker); "" -> Kafka
    follow: bool = False  # keep reading the file as it grows (a live recording)
    run: str = "sao"  # run name: topics <run>.trajectories, <run>.policy, <run>.learner
    bootstrap: str = ""  # Kafka bootstrap servers; "" -> $SAO_BOOTSTRAP -> 127.0.0.1:9092
    init: str = ""  # policy directory to start from (e.g. the warm start); "" -> a fresh `model`
    value_init: str = ""  # value-model directory; "" -> policy backbone + a fresh head
    weights_dir: str = ""  # policy-version store; "" -> no publication
    # newest versions kept in the store (a version is ~13 MB for the tiny model; 0: all); None: 32 with the
    # directory transport, 4 with http or broadcast (enough for a slow agent to fetch the version just announced)
    keep_versions: int | None = None
    # "http": a weight server beside the learner (rank 0, a daemon thread) serves the store to agents on other
    # hosts (streamer.transport.weight_server); "directory": agents read the store's path themselves
    weights_transport: WeightsTransport = "directory"
    weights_bind: str = "127.0.0.1:8765"  # http: HOST:PORT the weight server listens on (0.0.0.0: every interface)
    weights_advertised: str = ""  # http: HOST:PORT in announced uris ("" -> the bound address); informative only
    weights_chunk_bytes: int = 4 * 1024 * 1024  # the manifest's chunk size (each chunk has its own sha256)
    # "broadcast": rank 0 also sends each version to the agents in a process group of its own
    # (streamer.transport.weight_broadcast; the weight server above serves the agents outside it)
    weights_group_bind: str = "127.0.0.1:29600"  # broadcast: HOST:PORT of the group's rendezvous store
    weights_bucket_bytes: int = 64 * 1024 * 1024  # broadcast: weights are sent in buckets of at most this
    weights_group_timeout_s: float = 30.0  # broadcast: forming the group, and each bucket; then it is dissolved
    run_dir: str = ""  # run directory: learner events table (streamer.runs.artifacts); "" -> none
    events: str = ""  # LearnerEvent JSONL file; "" -> <checkpoint.dir>/events.jsonl

    def versions_kept(self) -> int:
        if self.keep_versions is not None:
            return self.keep_versions
        return 4 if self.weights_transport in PULLS else 32


BACKENDS, BACKEND_DTYPES = get_args(BackendName), get_args(BackendDtype)


@dataclass
class BackendConfig:
    name: BackendName = "torch"  # torch: one process; megatron: megatron-core MoE, one process per rank (torchrun)
    expert_parallel: int = 1  # megatron: ranks the experts are split over (divides world size, num_experts)
    tensor_parallel: int = 1  # megatron: ranks each matrix is split over (divides the heads; sequence parallel)
    pipeline_parallel: int = 1  # megatron: layer stages (megatron-core's 1F1B schedule, batch.micro_batch rows each)
    shard_optimizer: bool = False  # megatron: AdamW state sharded over the data-parallel ranks (ZeRO-1)
    dtype: BackendDtype = "float32"  # megatron weights: float32 (CPU, parity) or bfloat16 (GPUs)


@dataclass
class LearnerConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    value: ValueConfig = field(default_factory=ValueConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    io: IOConfig = field(default_factory=IOConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # used when io.init is empty
    backend: BackendConfig = field(default_factory=BackendConfig)
    # which optimizer profile `sao up` applies under the keys the user did not set (learner.profiles): auto picks
    # pretrained for a --model of 10M parameters or more, toy (these defaults) otherwise
    profile: ProfileName = "auto"
    seed: int = 0
    max_steps: int = 0  # stop after this many steps (0: run until the source ends)
    threads: int = 2  # torch intra-op threads
    # torch backend: the forwards' compute dtype. bfloat16: autocast over fp32 master weights, gradients and AdamW
    # state (TRL/accelerate's bf16=True, verl's FSDP mixed precision); refused where the device cannot compute it
    # (the embedded policy's packed forward is fp32-only: under bfloat16 it takes the HF forward)
    precision: Precision = "float32"
    device: Device = "auto"  # torch backend: where the models train; auto: the GPU torch sees first, else the CPU
    # torch backend: HF gradient checkpointing on the policy and the critic's backbone (activations recomputed in
    # backward: less memory, ~1/3 more compute); the embedded policy's packed forward is then not used
    gradient_checkpointing: bool = False

    @property
    def uses_value_model(self) -> bool:
        return self.advantage.estimator == "gae"

    def validate(self) -> None:
        _validate(self)


def _fail(field_name: str, msg: str) -> None:
    raise ConfigError(f"LearnerConfig.{field_name}: {msg}")


def _validate(c: LearnerConfig) -> None:
    if c.loss.name not in POLICY_LOSSES:
        _fail("loss.name", f"'{c.loss.name}' is not a policy loss; choose one of {', '.join(POLICY_LOSSES)}")
    for name in ("eps_low", "eps_high"):
        v = getattr(c.loss, name)
        if v is not None and not 0.0 <= v <= 10.0:
            _fail(f"loss.{name}", f"{v} is outside [0, 10]")
    if c.loss.eps_low is not None and c.loss.eps_low > 1.0:
        _fail("loss.eps_low", f"{c.loss.eps_low} > 1 would allow negative ratios; use <= 1")
    if c.loss.clip_c <= 1.0:
        _fail("loss.clip_c", f"{c.loss.clip_c} must be > 1 (dual clip caps r at clip_c for A < 0)")
    if not (c.loss.kl_coef >= 0.0 and c.loss.kl_coef != float("inf")):
        _fail("loss.kl_coef", f"{c.loss.kl_coef} must be finite and >= 0 (0: no KL penalty)")
    if c.loss.kl_type not in KL_TYPES:
        _fail("loss.kl_type", f"'{c.loss.kl_type}' unknown; choose one of {', '.join(KL_TYPES)}")
    if c.loss.kl_coef > 0 and c.backend.name == "megatron":
        _fail("loss.kl_coef", "the KL penalty to a reference policy is not supported on the megatron backend yet; "
                              "set loss.kl_coef=0 or backend.name=torch")
    for name, agg in (("loss.agg", c.loss.agg), ("value.agg", c.value.agg)):
        if agg is not None and agg not in AGGS:
            _fail(name, f"'{agg}' is not an aggregation; choose one of {', '.join(AGGS)}")
    a = c.advantage
    if a.estimator not in ESTIMATORS:
        _fail("advantage.estimator", f"'{a.estimator}' unknown; choose one of {', '.join(ESTIMATORS)}")
    for name in ("gamma", "lam_actor", "lam_critic"):
        if not 0.0 <= getattr(a, name) <= 1.0:
            _fail(f"advantage.{name}", f"{getattr(a, name)} is outside [0, 1]")
    if a.adaptive_alpha is not None and a.adaptive_alpha <= 0:
        _fail("advantage.adaptive_alpha", f"{a.adaptive_alpha} must be > 0 (or null to use lam_actor)")
    if a.estimator in NEEDS_GROUPS and (a.group_size < 2 or (c.batch.sync and c.batch.sync_batch % a.group_size)):
        _fail("advantage.group_size", f"{a.group_size}: a group estimator needs groups of >= 2 (in sync mode, "
                                      f"dividing batch.sync_batch {c.batch.sync_batch})")
    _validate_numbers(c)
    _validate_backend(c.backend, c.model, bool(c.io.init))
    _validate_weights(c.io)


def _validate_weights(io: IOConfig) -> None:
    if io.weights_transport not in WEIGHTS_TRANSPORTS:
        _fail("io.weights_transport", f"'{io.weights_transport}' unknown; choose {', '.join(WEIGHTS_TRANSPORTS)}")
    if io.keep_versions is not None and io.keep_versions < 0:
        _fail("io.keep_versions", f"{io.keep_versions} must be >= 0 (0: all; null: 32, or 4 over http)")
    if not 0 < io.weights_chunk_bytes <= 1 << 30:
        _fail("io.weights_chunk_bytes", f"{io.weights_chunk_bytes} must be in (0, 1 GiB]")
    if io.weights_transport in PULLS:
        parse_hostport(io.weights_bind, "LearnerConfig.io.weights_bind")
        if io.weights_advertised:
            parse_hostport(io.weights_advertised, "LearnerConfig.io.weights_advertised")
        if not io.weights_dir:
            _fail("io.weights_transport", f"{io.weights_transport} serves the weight store: set io.weights_dir too")
    if io.weights_transport == "broadcast":
        parse_hostport(io.weights_group_bind, "LearnerConfig.io.weights_group_bind")
        if io.weights_bucket_bytes < 1 or io.weights_group_timeout_s <= 0:
            _fail("io.weights_bucket_bytes", f"{io.weights_bucket_bytes} must be >= 1 and io.weights_group_timeout_s "
                                             f"{io.weights_group_timeout_s} > 0")


def _validate_backend(b: BackendConfig, model: ModelConfig, from_init: bool) -> None:
    """Static checks; the world size (divisible by expert_parallel) is checked when the ranks join."""
    if b.name not in BACKENDS:
        _fail("backend.name", f"'{b.name}' unknown; choose one of {', '.join(BACKENDS)}")
    if b.dtype not in BACKEND_DTYPES:
        _fail("backend.dtype", f"'{b.dtype}' unknown; choose one of {', '.join(BACKEND_DTYPES)}")
    for name in ("expert_parallel", "tensor_parallel", "pipeline_parallel"):
        if getattr(b, name) < 1:
            _fail(f"backend.{name}", f"{getattr(b, name)} must be >= 1")
    for name in ("tensor_parallel", "pipeline_parallel", "shard_optimizer"):
        if b.name == "torch" and getattr(b, name) != getattr(BackendConfig, name):  # not the default
            _fail(f"backend.{name}", f"{getattr(b, name)} needs the megatron backend; set backend.name=megatron")
    if b.name == "megatron" and not from_init:
        if model.num_layers < b.pipeline_parallel:
            _fail("backend.pipeline_parallel", f"{b.pipeline_parallel} stages for model.num_layers "
                                               f"{model.num_layers}: each stage needs a layer")
        for field, n in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads)):
            if n % b.tensor_parallel:
                _fail("backend.tensor_parallel", f"{b.tensor_parallel} does not divide model.{field} {n}")
    if b.name == "torch" and (b.expert_parallel != 1 or b.dtype != "float32"):
        _fail("backend.expert_parallel" if b.expert_parallel != 1 else "backend.dtype",
              "expert parallelism and bfloat16 weights need the megatron backend; set backend.name=megatron")
    if b.name == "megatron" and not from_init and model.num_experts % b.expert_parallel:
        _fail("backend.expert_parallel", f"{b.expert_parallel} does not divide model.num_experts "
                                         f"{model.num_experts}; use a divisor of it")
    if b.name == "megatron" and not from_init and model.experts_per_token == 1 and model.norm_topk_prob:
        _fail("model.experts_per_token", "1 with model.norm_topk_prob=true cannot run on megatron-core (it "
                                         "refuses top-1 routing after the softmax); use >= 2")


def _validate_numbers(c: LearnerConfig) -> None:
    positive = {"optim.lr": c.optim.lr, "optim.value_lr": c.optim.value_lr, "optim.grad_clip": c.optim.grad_clip,
                "optim.updates_per_batch": c.optim.updates_per_batch, "batch.tokens": c.batch.tokens,
                "batch.max_trajectories": c.batch.max_trajectories, "batch.micro_batch": c.batch.micro_batch,
                "batch.sync_every": c.batch.sync_every, "batch.sync_batch": c.batch.sync_batch,
                "batch.poison_after": c.batch.poison_after,
                "checkpoint.every": c.checkpoint.every, "checkpoint.keep": c.checkpoint.keep,
                "value.spike_factor": c.value.spike_factor, "threads": c.threads}
    for name, v in positive.items():
        if not v > 0:
            _fail(name, f"{v} must be > 0")
    non_negative = {"batch.max_staleness": c.batch.max_staleness, "value.warmup_steps": c.value.warmup_steps,
                    "value.rewarm_steps": c.value.rewarm_steps, "max_steps": c.max_steps,
                    "batch.dedup_window": c.batch.dedup_window, "batch.idle_flush_s": c.batch.idle_flush_s,
                    "batch.micro_tokens": c.batch.micro_tokens}
    for name, v in non_negative.items():
        if v < 0:
            _fail(name, f"{v} must be >= 0")
    if not 0.0 <= c.value.spike_ema < 1.0:
        _fail("value.spike_ema", f"{c.value.spike_ema} must be in [0, 1)")
    if c.value.layers is not None and c.value.layers < 1:
        _fail("value.layers", f"{c.value.layers} must be >= 1 (or null: all the policy's layers)")
    if c.value.layers is not None and c.backend.name == "megatron":
        _fail("value.layers", "a critic shallower than the policy is not supported on the megatron backend yet; "
                              "set value.layers=null or backend.name=torch")
    _validate_memory_options(c)
    if c.value.value_clip is not None and c.value.value_clip <= 0:
        _fail("value.value_clip", f"{c.value.value_clip} must be > 0 (or null to disable the clip)")


def _validate_memory_options(c: LearnerConfig) -> None:
    lora, megatron = c.policy.lora, c.backend.name == "megatron"
    for name, kinds in (("precision", Precision), ("device", Device)):
        if getattr(c, name) not in get_args(kinds):
            _fail(name, f"'{getattr(c, name)}' unknown; choose one of {', '.join(get_args(kinds))}")
    if lora.r < 0 or (lora.r and not (lora.alpha > 0 and 0.0 <= lora.dropout < 1.0 and lora.target_modules)):
        _fail("policy.lora", f"r={lora.r} alpha={lora.alpha} dropout={lora.dropout} target_modules="
                             f"{lora.target_modules}: need r >= 0 (0: off), alpha > 0, dropout in [0, 1) and a module")
    if lora.publish == "adapters" and not lora.r:
        _fail("policy.lora.publish", "adapters needs LoRA on (policy.lora.r > 0)")
    if lora.publish == "adapters" and c.io.weights_transport == "broadcast":
        _fail("policy.lora.publish", "adapters over io.weights_transport=broadcast is not supported yet; publish "
                                     "merged weights or use the directory or http transport")
    torch_only = {"precision": c.precision != "float32", "gradient_checkpointing": c.gradient_checkpointing,
                  "batch.micro_tokens": c.batch.micro_tokens > 0}
    for name in (k for k, on in torch_only.items() if on and megatron):
        _fail(name, "the megatron backend does not support it (its weights' dtype is backend.dtype); use "
                    "backend.name=torch or leave it at its default")
    if megatron and (lora.r or c.value.kind == "head"):
        _fail("policy.lora.r" if lora.r else "value.kind", "LoRA and the value head are not supported on the megatron "
                                                          "backend yet; use backend.name=torch")
    if c.value.kind == "head" and (c.value.layers is not None or c.io.value_init):
        _fail("value.kind", "head sits on the policy's own backbone: value.layers and io.value_init apply to "
                            "value.kind=copy only")

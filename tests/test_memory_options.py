"""The torch backend's memory options on the toy models (real forwards and backwards): token-sized micro-batches
(batch.micro_tokens), gradient checkpointing and bf16 autocast (learner.precision) give the plain path's loss and
gradients (the first two to float32 rounding, bf16 within a looser stated tolerance), alone and with LoRA and the
value head."""

from __future__ import annotations

import pytest
import torch

from learner.models.memory import check_precision, learner_device, native_bf16
from learner.models.policy import build_policy
from learner.train import build_models
from learner.trainer.batching import Batch, by_length, collate
from learner.trainer.step import _micro, prepare, update
from learner.trainer.synthetic import synthetic_trajectories, tiny_model_config
from streamer.wire.config import ConfigError
from tests.test_trainer import make_cfg

ONE_MICRO = "batch.micro_batch=64"  # every row in one micro-batch but for the 2x-length rule (`_micro`)
EXACT = 2e-6  # float32 reordering: relative error of the whole gradient, and of the losses
BF16 = 2e-2  # bf16 matmuls (8-bit mantissa) over fp32 weights: relative error of the gradient and the losses
LORA = ("policy.lora.r=4", "policy.lora.alpha=8")
HEAD = ("value.kind=head", "value.detach_backbone=false")


@pytest.fixture(scope="module")
def batch() -> Batch:
    return collate(by_length(synthetic_trajectories(build_policy(tiny_model_config(), seed=0), 12)))


def one_update(tmp_path, batch, *options, watch=None):
    """Metrics and gradients (policy `p.*`, critic `v.*`) of one update; grad_clip off so the raw gradients show.
    `watch(models)`: registers the hooks that observe it."""
    cfg = make_cfg(tmp_path, "optim.grad_clip=1e9", *options)
    models = build_models(cfg)
    if watch is not None:
        watch(models)
    metrics, applied = update(cfg, models, batch, prepare(cfg, models, batch), True)
    assert applied
    grads = {f"p.{n}": p.grad.clone() for n, p in models.policy.named_parameters() if p.grad is not None}
    grads.update({f"v.{n}": p.grad.clone() for n, p in models.value.named_parameters() if p.grad is not None})
    return metrics, grads, models


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[k].flatten() for k in sorted(grads)])


def assert_same_step(got, want, tol: float) -> None:
    (m, g), (m0, g0) = got[:2], want[:2]
    assert set(g) == set(g0) and len(g0) > 2
    for k in ("policy_loss", "value_loss"):
        assert m[k] == pytest.approx(m0[k], rel=tol, abs=tol)
    for prefix in ("p.", "v."):  # each model's gradient as a whole
        mine = {k: v for k, v in g.items() if k.startswith(prefix)}
        ref = {k: v for k, v in g0.items() if k.startswith(prefix)}
        err = float((flat(mine) - flat(ref)).norm() / flat(ref).norm())
        assert err < tol, f"{prefix} gradient: relative error {err:.2e} > {tol:.0e}"


def test_token_micro_batches_by_hand():
    # rows sorted by length 2, 3, 3, 4, 7, 12 at micro_tokens 9: [2, 3, 3] pads to 3 x 3 = 9 (a 4th row: 4 x 4 > 9);
    # [4] (with 7: 2 x 7 = 14 > 9); [7]; and 12 > 9 goes alone
    lengths = [2, 3, 3, 4, 7, 12]
    mask = torch.tensor([[1] * n + [0] * (12 - n) for n in lengths])
    b = Batch(mask, mask, mask.float(), mask.float(), torch.zeros(6), [])
    assert list(_micro(b, 1, tokens=9)) == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert list(_micro(b, 1, tokens=100)) == [(0, 4), (4, 6)]  # the 2x-length rule still cuts 7 (> 2 x 2) off
    assert list(_micro(b, 2)) == [(0, 2), (2, 4), (4, 6)]  # tokens 0: micro_batch rows, as before


@pytest.mark.parametrize("options", [(), LORA + HEAD])
def test_token_micro_batches_give_the_unsplit_loss_and_gradients(tmp_path, batch, options):
    calls = []
    split = one_update(tmp_path, batch, "batch.micro_tokens=20", *options,
                       watch=lambda m: m.policy.lm_head.register_forward_hook(lambda *_: calls.append(1)))
    assert len(calls) == 10  # the policy's forwards: 12 rows of 6-13 tokens at <= 20 padded tokens a pass
    assert_same_step(split, one_update(tmp_path, batch, ONE_MICRO, *options), EXACT)


@pytest.mark.parametrize("options", [(), LORA, HEAD, LORA + HEAD])
def test_gradient_checkpointing_gives_the_same_gradients_and_recomputes(tmp_path, batch, options):
    calls = []  # a pre-hook: torch's recomputation stops early, once it has what backward needs (no forward hook)
    on = one_update(tmp_path, batch, "gradient_checkpointing=true", ONE_MICRO, *options,
                    watch=lambda m: m.policy.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1)))
    models = on[2]
    assert models.policy.model.gradient_checkpointing
    if HEAD[0] not in options:
        assert models.value.backbone.gradient_checkpointing
    # 2 micro-batches (the 2x rule): each runs the layer once in forward and once more in backward's recomputation;
    # a joint head's value forwards run on the same backbone too: 2 in prepare (no gradient, no recomputation) + 4
    assert len(calls) == (10 if HEAD[0] in options else 4)
    assert_same_step(on, one_update(tmp_path, batch, ONE_MICRO, *options), EXACT)


@pytest.mark.parametrize("options", [(), LORA + HEAD])
def test_bf16_computes_in_bf16_over_fp32_weights_within_its_tolerance(tmp_path, batch, options):
    dtypes = []
    bf16 = one_update(tmp_path, batch, "precision=bfloat16", ONE_MICRO, *options,
                      watch=lambda m: m.policy.model.layers[0].self_attn.q_proj.register_forward_hook(
                          lambda _m, _i, out: dtypes.append(out.dtype)))
    assert dtypes and set(dtypes) == {torch.bfloat16}
    models = bf16[2]
    weights = list(models.policy.parameters()) + list(models.value.parameters())
    assert {p.dtype for p in weights} == {torch.float32}  # master weights, their gradients and AdamW state: fp32
    assert {s["exp_avg"].dtype for s in models.policy_opt.state.values()} == {torch.float32}
    plain = one_update(tmp_path, batch, ONE_MICRO, *options)
    assert_same_step(bf16, plain, BF16)
    assert bf16[0]["policy_loss"] != plain[0]["policy_loss"]  # it did compute in bf16


def test_all_options_together_take_a_finite_step(tmp_path, batch):
    m, g, _ = one_update(tmp_path, batch, "precision=bfloat16", "gradient_checkpointing=true",
                         "batch.micro_tokens=24", *LORA, *HEAD)
    assert all(torch.isfinite(v).all() for v in g.values())
    assert_same_step((m, g), one_update(tmp_path, batch, ONE_MICRO, *LORA, *HEAD), BF16)


@pytest.mark.parametrize("override, field", [
    ("batch.micro_tokens=-1", "batch.micro_tokens"),
    ("precision=float16", "precision"),
    ("device=tpu", "device"),
])
def test_bad_values_name_the_key(tmp_path, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make_cfg(tmp_path, override)


@pytest.mark.parametrize("override, field", [
    ("precision=bfloat16", "precision"), ("gradient_checkpointing=true", "gradient_checkpointing"),
    ("batch.micro_tokens=512", "batch.micro_tokens"),
])
def test_the_torch_options_are_refused_on_megatron(tmp_path, override, field):
    with pytest.raises(ConfigError, match=rf"LearnerConfig\.{field}: the megatron backend does not support it"):
        make_cfg(tmp_path, "backend.name=megatron", "model.experts_per_token=2", override)


def test_bf16_is_refused_where_the_device_cannot(tmp_path):
    check_precision("bfloat16", torch.device("cpu"))  # torch computes bf16 on any CPU (native or emulated)
    check_precision("float32", torch.device("cuda"))  # float32: nothing to check
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="LearnerConfig.precision: bfloat16 needs a GPU with bf16"):
            check_precision("bfloat16", torch.device("cuda"))


def test_the_learner_device_is_the_gpu_when_there_is_one(tmp_path):
    gpu = torch.cuda.is_available()
    assert learner_device("auto").type == ("cuda" if gpu else "cpu") and learner_device("cpu").type == "cpu"
    if not gpu:
        with pytest.raises(ConfigError, match="LearnerConfig.device: cuda, but torch sees no GPU"):
            learner_device("cuda")
    models = build_models(make_cfg(tmp_path, "device=cpu"))
    assert models.backend.device.type == "cpu" and next(models.policy.parameters()).device.type == "cpu"


def test_native_bf16_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n")
    assert native_bf16(info) is True
    info.write_text("processor: 0\nflags\t\t: fpu sse avx2\n")
    assert native_bf16(info) is False
    assert native_bf16(tmp_path / "missing") is None

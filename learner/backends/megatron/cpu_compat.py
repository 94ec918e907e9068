"""Make megatron-core 0.16.x run on CPU with gloo. Applied only when CUDA is absent.

megatron-core assumes CUDA in a handful of places even with the local (non Transformer-Engine)
layer spec. Each patch below replaces one such call with its CPU equivalent; none changes the
numerics of a forward or backward pass. On a CUDA machine `apply()` does nothing, so NCCL, the
CUDA RNG tracker and (when installed) Transformer Engine are used unchanged.

Patched:
  1. `torch.cuda.current_device()` (buffers allocated in `_AllToAll`, attention, GPTModel):
     returns "cpu", a valid `device=` argument.
  2. the default causal mask (`fused_softmax.get_default_causal_mask`, built on device="cuda"),
     and the sliding-window mask next to it.
  3. the CUDA RNG tracker (`model_parallel_cuda_manual_seed`, forked around attention dropout and
     expert init): a tracker keeping named CPU generator states instead.
  4. the alltoall token dispatcher's device-to-host step (CUDA streams and events): on CPU it
     only turns the split sizes into numpy arrays, which is what gloo's `all_to_all_single`
     needs (tensors are rejected as split sizes).
  5. `moe_utils.te_general_gemm`, referenced even when Transformer Engine is absent: set to
     None so the router GEMM falls back to `torch.mm`.
  6. the pipeline schedules' token counter, `torch.zeros([], device="cuda")`: the `torch` that module
     sees puts a "cuda" zeros on the CPU (every other name is torch's own). The schedules' batched p2p
     is followed by `torch.cuda.synchronize()`: avoided instead (`batch_p2p_comm=False` on CPU, plain
     isend/irecv, which gloo has).
  7. `LanguageModule.setup_embeddings_and_output_layer` (tied embeddings at PP > 1) moves the last
     stage's copy of the embedding with `.cuda()` before the all-reduce that initialises it: during
     that call, `Tensor.cuda` returns the tensor itself (the backend then loads both copies anyway).
Not patched, avoided instead: Megatron's DDP, distributed optimizer and bf16 optimizer assert
CUDA tensors; the backend uses a plain torch optimizer and its own gradient all-reduce
(`learner.backends.megatron.grads`).
"""

from __future__ import annotations

import contextlib
import functools

import torch

_APPLIED = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Apply every patch once if CUDA is absent; returns whether the patches are active."""
    global _APPLIED
    if _APPLIED:
        return True
    if not needed():
        return False
    _patch_current_device()
    _patch_causal_masks()
    _patch_rng_tracker()
    _patch_alltoall_dtoh()
    _patch_te_gemm()
    _patch_schedules_zeros()
    _patch_tied_embedding_setup()
    _APPLIED = True
    return True


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


@functools.lru_cache(maxsize=None)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _sliding_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _patch_causal_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    for mod in (utils, fused_softmax):
        mod.get_default_causal_mask = _causal_mask
        mod.get_sliding_window_causal_mask = _sliding_window_mask


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Named CPU generator states; `fork(name)` runs its body on that state."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"rng tracker: seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng tracker: state '{name}' already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"rng tracker: state '{name}' was never added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _as_numpy(x):
    return x.numpy() if torch.is_tensor(x) else x


def _cpu_dtoh(self, point: str, tokens_per_expert=None):
    # Same contract as MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize, minus streams:
    # everything already lives on the CPU; gloo wants the split sizes as numpy, not tensors.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _as_numpy(self.input_splits)
        self.output_splits = _as_numpy(self.output_splits)
        self.output_splits_tp = _as_numpy(self.output_splits_tp)
    return tokens_per_expert


def _patch_alltoall_dtoh() -> None:
    from megatron.core.transformer.moe import token_dispatcher as td

    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh
    # The class creates `torch.cuda.Stream()` once in __init__ when this is None.
    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()


def _patch_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _TorchCpuZeros:
    """`torch` for megatron's schedules module: `zeros(..., device="cuda")` lands on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _patch_schedules_zeros() -> None:
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchCpuZeros()


def _patch_tied_embedding_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self, *args, **kwargs):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = setup

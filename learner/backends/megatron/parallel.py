"""Process groups for the megatron backend: torch.distributed + megatron parallel state.

Launched by torchrun (or Ray workers that set the same env: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Backend: NCCL when CUDA is present, gloo otherwise (with `cpu_compat` applied).
Parallelism: data parallel over all ranks, experts split over `expert_parallel` of them
(TP = PP = 1); expert weights are replicated over world / expert_parallel ranks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from learner.backends.megatron import cpu_compat


def init(expert_parallel: int = 1, seed: int = 0) -> None:
    """Join the process group (from torchrun's env) and set megatron's parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_compat.apply()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a lone process: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if expert_parallel < 1 or world % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} must divide the world size {world}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=expert_parallel)
    model_parallel_cuda_manual_seed(seed)


def reset() -> None:
    """Drop megatron's parallel state (the torch process group stays), e.g. to change EP."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def shutdown() -> None:
    reset()
    if dist.is_initialized():
        dist.destroy_process_group()


def ep_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

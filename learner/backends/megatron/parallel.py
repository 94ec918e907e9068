"""Process groups for the megatron backend: torch.distributed + megatron parallel state.

Launched by torchrun (or Ray workers that set the same env: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Backend: NCCL when CUDA is present, gloo otherwise (with `cpu_compat` applied).
Parallelism (megatron-core's own groups, order tp-cp-ep-dp-pp): `tensor_parallel` ranks split every
attention/MLP/embedding matrix (with sequence parallelism, which megatron-core requires for MoE training
at TP > 1), `pipeline_parallel` stages split the layers, `expert_parallel` ranks split the experts, and
`expert_tensor_parallel` ranks split each expert's matrices (default: 1, whole experts, so (TP 2, EP 2)
fits two ranks); data parallel over what is left.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from learner.backends.megatron import cpu_compat


def init(expert_parallel: int = 1, seed: int = 0, tensor_parallel: int = 1, pipeline_parallel: int = 1,
         expert_tensor_parallel: int = 1) -> None:
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
    check_layout(world, expert_parallel, tensor_parallel, pipeline_parallel, expert_tensor_parallel)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                 pipeline_model_parallel_size=pipeline_parallel,
                                 expert_model_parallel_size=expert_parallel,
                                 expert_tensor_parallel_size=expert_tensor_parallel)
    model_parallel_cuda_manual_seed(seed)


def check_layout(world: int, ep: int, tp: int = 1, pp: int = 1, etp: int = 1) -> None:
    """ValueError naming the size that does not fit: TP * PP and ETP * EP * PP must divide the world."""
    for name, v in (("expert_parallel", ep), ("tensor_parallel", tp), ("pipeline_parallel", pp),
                    ("expert_tensor_parallel", etp)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    if world % (tp * pp):
        raise ValueError(f"tensor_parallel={tp} x pipeline_parallel={pp} must divide the world size {world}")
    if world % (etp * ep * pp):
        raise ValueError(f"expert_parallel={ep} x expert_tensor_parallel={etp} x pipeline_parallel={pp} "
                         f"must divide the world size {world}")


def layout() -> dict[str, int]:
    """This rank's place: sizes and ranks of TP, PP, DP, EP, ETP and expert DP."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_world_size(), "dp_rank": ps.get_data_parallel_rank(),
            "ep": ps.get_expert_model_parallel_world_size(), "ep_rank": ps.get_expert_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_world_size(), "etp_rank": ps.get_expert_tensor_parallel_rank(),
            "edp_rank": ps.get_expert_data_parallel_rank()}


def stage_ranges(n_layers: int, pp: int) -> list[range]:
    """Each stage's global layers: L // PP each, the first stage also the remainder."""
    if n_layers < pp:
        raise ValueError(f"pipeline_parallel={pp} exceeds the model's {n_layers} layers")
    per, extra = divmod(n_layers, pp)
    starts = [0] + [per + extra + i * per for i in range(pp)]
    return [range(starts[s], starts[s + 1]) for s in range(pp)]


def config_settings(n_layers: int, pp: int) -> dict:
    """TransformerConfig fields giving megatron-core the split of `stage_ranges`."""
    per, extra = divmod(n_layers, pp)
    return {"num_layers_in_first_pipeline_stage": per + extra} if pp > 1 and extra else {}


def reset() -> None:
    """Drop megatron's parallel state (the torch process group stays), e.g. to change EP."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def shutdown() -> None:
    reset()
    if dist.is_initialized():
        dist.destroy_process_group()


def report_and_shutdown(out: dict, path: str) -> int:
    """A check script's end: rank 0 writes `out` as JSON to `path`, then the parallel state goes; returns 0."""
    import json

    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
    shutdown()
    return 0


def writer_index(writer: bool) -> tuple[int, int]:
    """(this rank's index among the ranks that pass `writer`, in global rank order, or -1; how many do): a
    collective over the world."""
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(writer)]))
    before = sum(int(f) for f in flags[:dist.get_rank()])
    return (before if writer else -1), sum(int(f) for f in flags)


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

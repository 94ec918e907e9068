"""Publishing by shard against the full gather, on the same weights, run under torchrun.

    python -m torch.distributed.run --nproc_per_node 2 -m learner.backends.megatron.publish_check \
        --out DIR [--model-dir DIR ...] [--layout 2,1,1 --layout 1,2,1 ...] [--bf16-ep 2]

For each model (the tiny Qwen3-MoE of `ModelConfig`, then each --model-dir HF causal LM, e.g. a tiny GLM-4-MoE)
and each layout (EP,TP,PP; default EP 2 and EP 1): every rank builds the learner from the same HF weights and
takes one SAO step (so the published weights are trained ones: replicated tensors updated on every rank, experts
on their own), then the same weights are published twice, into two stores under DIR/<model>_ep<N>_tp<N>_pp<N>[_bf16]/:

  full/    today's export: `export_hf_policy` (every rank all-gathers the experts, TP slices and stages and
           builds a full fp32 HF model), then rank 0's `DirectoryPublisher.publish` (one model.safetensors)
  shards/  `learner.trainer.publish_shards.publish_sharded` over the ranks, each writing its own part
           (`MegatronLearner.policy_shard`); the whole-model gathers (experts, TP slices, stages) raise if anything
           calls them meanwhile

Rank 0 writes DIR/publish.json: per layout, each rank's shard stats (tensors and routed-expert tensors converted,
bytes converted, the most bytes held at once, the largest whole megatron tensor it walks) and what the full gather
holds on each rank (the gathered HF state dict, the HF model built from it, rank 0's serialized file), in bytes;
and for each way, how far the rank's resident set rose during the publish (`rss_growth`, `full_rss_growth`: peak
RSS over RSS before, Linux, the sharded publish measured first). `--bf16-ep N` adds a layout trained in bf16 (no
step: the publish only), whose shards keep bf16. tests/test_megatron_publish.py compares the stores.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from learner.backends.megatron import convert, parallel, pipeline, tp
from learner.backends.megatron.learner import MegatronLearner, MegatronOptions, OptimSettings
from learner.backends.megatron.model import moe_layer_pattern, num_experts
from learner.backends.megatron.parity import _hf_models, batch_for, sao, with_behaviour


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _per_rank(values: list[int]) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _rss_growth(fn) -> int:
    """How far this process's resident set rose above its level before `fn()` at its peak during it (Linux: the
    peak is reset through /proc/self/clear_refs, freed heap handed back first); -1 where that cannot be read."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        fn()
        return -1
    before = _vm("VmRSS")
    fn()
    return _vm("VmHWM") - before


def _no_gather(*_a, **_k):
    raise AssertionError("publish by shard called a whole-model gather")


_GATHERS = ((convert, "gather_experts"), (tp, "gather_state"), (pipeline, "gather_stages"))


def check(name: str, model_dir: str | None, layout: tuple[int, int, int], dtype: str, root: Path) -> dict:
    from learner.models.tokenizer import CharTokenizer
    from learner.trainer.publish import DirectoryPublisher
    from learner.trainer.publish_shards import publish_sharded
    from learner.trainer.ranks import RankGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    ep, tp, pp = layout
    policy, _ = _hf_models(model_dir)
    options = MegatronOptions(expert_parallel=ep, tensor_parallel=tp, pipeline_parallel=pp, dtype=dtype)
    lrn = MegatronLearner(policy, None, options, OptimSettings(lr=1e-3, grad_clip=1.0), sao)
    if dtype == "float32":  # each data-parallel replica its own rows (its TP ranks and stages the same)
        batches = with_behaviour([batch_for(r, policy.config.vocab_size) for r in range(world)], policy)
        lrn.policy_step(batches[lrn.layout["dp_rank"]])
    out_dir = root / f"{name}_ep{ep}_tp{tp}_pp{pp}{'' if dtype == 'float32' else '_bf16'}"
    tok = CharTokenizer()
    # by shard: every rank its own part, no gather
    group = RankGroup(lrn.device)
    shard = lrn.policy_shard()
    publisher = DirectoryPublisher(out_dir / "shards", tokenizer=tok) if rank == 0 else None
    saved = [getattr(mod, fn) for mod, fn in _GATHERS]
    for mod, fn in _GATHERS:
        setattr(mod, fn, _no_gather)
    try:
        shard_rss = _rss_growth(lambda: publish_sharded(publisher, shard, lrn.hf_config, 1, 1, group))
    finally:
        for (mod, fn), f in zip(_GATHERS, saved):
            setattr(mod, fn, f)
    # today's export: every rank gathers and builds the whole model; rank 0 writes it
    gathered = lrn.policy_state_dict()
    gathered_bytes = _unique_bytes(gathered.values())
    del gathered
    model_bytes = _unique_bytes(lrn.empty_hf_policy().state_dict().values())
    full = DirectoryPublisher(out_dir / "full", tokenizer=tok) if rank == 0 else None

    def full_publish() -> None:
        model = lrn.export_hf_policy()
        if full is not None:
            full.publish(model, 1, 1)

    full_rss = _rss_growth(full_publish)
    file_bytes = (out_dir / "full" / "v000001" / "model.safetensors").stat().st_size if rank == 0 else 0
    s = shard.stats
    largest = shard.whole_bytes()
    rows = _per_rank([shard.index, s["tensors"], s["expert_tensors"], s["bytes"], s["peak_bytes"], largest,
                      shard_rss, gathered_bytes, model_bytes, file_bytes, full_rss])
    keys = ("shard", "tensors", "expert_tensors", "bytes", "peak_bytes", "largest_tensor_bytes", "rss_growth",
            "full_gathered_bytes", "full_model_bytes", "full_file_bytes", "full_rss_growth")
    cfg = lrn.hf_config
    return {"dir": str(out_dir), "ep": ep, "tp": tp, "pp": pp, "world": world, "dtype": dtype,
            "expert_tensors_total": 3 * num_experts(cfg) * sum(moe_layer_pattern(cfg)),
            "ranks": [dict(zip(keys, row)) for row in rows]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model-dir", action="append", default=[], help="HF causal LM directories (after the tiny "
                                                                          "Qwen3-MoE)")
    ap.add_argument("--layout", action="append", default=[], help="EP,TP,PP (repeatable; default 2,1,1 and 1,1,1)")
    ap.add_argument("--bf16-ep", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("SAO_TEST_THREADS", "1")))
    torch.manual_seed(0)
    parallel.init(1)
    root = Path(args.out)
    models = [("qwen3_moe", None), *((Path(d).name, d) for d in args.model_dir)]
    results = []
    for name, model_dir in models:
        for layout in args.layout or ["2,1,1", "1,1,1"]:
            ep, tp, pp = (int(x) for x in layout.split(","))
            results.append({"model": name, **check(name, model_dir, (ep, tp, pp), "float32", root)})
        if args.bf16_ep:
            results.append({"model": name, **check(name, model_dir, (args.bf16_ep, 1, 1), "bfloat16", root)})
    if dist.get_rank() == 0:
        (root / "publish.json").write_text(json.dumps(results, indent=2))
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

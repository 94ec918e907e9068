"""A capacity model for 7B, 70B and 750B-A40B, whose small-scale inputs are figures measured here.

    .venv/bin/python -m experiments.capacity                 # writes docs/results/capacity.json

Measured inputs (committed JSON): the CPU cost per byte of publishing a version and of an agent verifying and
loading it, by transport (`bench/weights.py` on the ~500M model in bf16: docs/results/weights.json); bytes per
token of a trajectory on the wire and what one partition of `<run>.trajectories` carried
(docs/results/data_plane/); the SAO step's cost over a bare forward+backward (docs/results/components/
learner_step.json). Assumed inputs (stated in the JSON, change them with --set): network bandwidths, GPU peak
FLOP/s and the MFU of training and of generation. The model, per version of B bytes sent to N agents:

- directory (a shared filesystem of bandwidth F): publish + B / F (write) + N * B / F (reads share F) + load;
- pull (HTTP from the learner's rank 0, uplink W): publish + N * B / W + load (rank 0's uplink is the bottleneck);
- broadcast (a pipelined ring/tree over links of W): publish + B / W + load (independent of N once pipelined);
with publish and load the measured CPU seconds per byte times B (one host's single-threaded path: an upper bound).

The learner/rollout split balances FLOPs: a trained token costs (6 N_active for the policy + 6 N_value for the
critic) x the measured SAO-over-bare ratio + 2 N_active for the reference's KL forward; a generated token costs
2 N_active; rollout GPUs / learner GPUs = (2 / MFU_gen) / (train FLOPs per token / (N_active x MFU_train)).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path("docs/results")
MODELS = {  # name: (total parameters, active parameters per token)
    "7B": (7e9, 7e9),
    "70B": (70e9, 70e9),
    "750B-A40B": (750e9, 40e9),
}
ASSUMED = {
    "agents": 64,  # rollout engines that must receive every version
    "link_gbit_s": [25, 100, 400],  # per-host network (Ethernet to InfiniBand NDR)
    "shared_fs_gbyte_s": 10.0,  # aggregate bandwidth of a parallel filesystem
    "gpu_peak_tflops": 989.0,  # H100 SXM dense bf16
    "mfu_train": 0.35,
    "mfu_generate": 0.10,  # decoding is memory-bound
    "value_params_fraction": 1.0,  # the critic's size over the policy's (a full copy by default)
    "tokens_per_trajectory": 2048,
    # ranks that publish their own shard of a version (the Megatron learner's expert/tensor parallel ranks) and, on
    # the agents' side, GPUs of one rollout engine loading their part in parallel: the CPU path divides by it
    "shards": {"7B": 8, "70B": 64, "750B-A40B": 256},
}
BYTES_PER_PARAM = 2  # bf16 versions


def measured_inputs() -> dict:
    weights = json.loads((RESULTS / "weights.json").read_text())
    size = weights["models"]["500m"]["file_bytes"]["bfloat16"]
    rows = [r for r in weights["rows"] if r["size"] == "500m" and r["dtype"] == "bfloat16" and r["agents"] == 1]
    per_byte = {r["transport"]: {"publish_s_per_gb": r["publish_s"] / size * 1e9,
                                 "load_s_per_gb": r["agent_load_s"] / size * 1e9} for r in rows}
    encoding = json.loads((RESULTS / "data_plane/trajectory_encoding.json").read_text())
    longest = max(encoding["cases"], key=lambda c: (c["vocab"], c["tokens"]))
    partition = json.loads((RESULTS / "data_plane/trajectory_partition.json").read_text())
    live = max(c["live_read"]["per_s"] * c["tokens"] for c in partition["cases"])
    step = json.loads((RESULTS / "components/learner_step.json").read_text())
    return {
        "version_cpu_cost": per_byte,
        "wire_bytes_per_token": longest["msgpack_lists"]["bytes"] / longest["tokens"],
        "partition_tokens_per_s": live,  # one partition, read live by the learner, on 2 shared cores
        "sao_over_bare": step["ratio_sao_over_bare"],
        "sources": ["docs/results/weights.json", "docs/results/data_plane/trajectory_encoding.json",
                    "docs/results/data_plane/trajectory_partition.json", "docs/results/components/learner_step.json"],
    }


def propagation_s(transport: str, nbytes: float, agents: int, link_bytes_s: float, fs_bytes_s: float,
                  cost: dict, shards: int = 1) -> float:
    """Seconds from the learner's publish call to the last of `agents` engines holding the version; the CPU path
    (serialise, hash, verify, load) runs on `shards` ranks in parallel; the wire is shared as the transport shares
    it."""
    cpu = (cost["publish_s_per_gb"] + cost["load_s_per_gb"]) * nbytes / 1e9 / shards
    wire = {"directory": (1 + agents) * nbytes / fs_bytes_s,
            "http": agents * nbytes / link_bytes_s,
            "broadcast": nbytes / link_bytes_s}[transport]
    return cpu + wire


def gpu_split(active: float, a: dict, sao_over_bare: float) -> dict:
    train_flops = (6 * active * (1 + a["value_params_fraction"])) * sao_over_bare + 2 * active
    per_gpu_train = a["gpu_peak_tflops"] * 1e12 * a["mfu_train"] / train_flops
    per_gpu_generate = a["gpu_peak_tflops"] * 1e12 * a["mfu_generate"] / (2 * active)
    return {"train_tokens_per_gpu_s": per_gpu_train, "generate_tokens_per_gpu_s": per_gpu_generate,
            "rollout_gpus_per_learner_gpu": per_gpu_train / per_gpu_generate}


def model_rows(m: dict, a: dict) -> list[dict]:
    rows = []
    for name, (total, active) in MODELS.items():
        nbytes = total * BYTES_PER_PARAM
        split = gpu_split(active, a, m["sao_over_bare"])
        link = {g: g * 1e9 / 8 for g in a["link_gbit_s"]}
        fs = a["shared_fs_gbyte_s"] * 1e9
        cost = m["version_cpu_cost"]
        times = {f"{t}@{g}": propagation_s(t, nbytes, a["agents"], link[g], fs, cost[t])
                 for t in ("directory", "http", "broadcast") for g in a["link_gbit_s"]}
        sharded = {f"{t}@{g}": propagation_s(t, nbytes, a["agents"], link[g], fs, cost[t], a["shards"][name])
                   for t in ("directory", "http", "broadcast") for g in a["link_gbit_s"]}
        wire = split["generate_tokens_per_gpu_s"] * m["wire_bytes_per_token"]
        rows.append({"model": name, "params": total, "active": active, "bytes_per_version": nbytes,
                     "propagation_s": times,
                     "shards": a["shards"][name], "propagation_sharded_s": sharded, **split,
                     "trajectory_bytes_per_rollout_gpu_s": wire,
                     "rollout_gpus_per_partition": m["partition_tokens_per_s"] / split["generate_tokens_per_gpu_s"]})
    return rows


def build(assumed: dict | None = None) -> dict:
    a = {**ASSUMED, **(assumed or {})}
    m = measured_inputs()
    return {"experiment": "capacity", "measured": m, "assumed": a, "models": model_rows(m, a)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS / "capacity.json"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an assumed input (JSON value)")
    args = p.parse_args(argv)
    assumed = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    unknown = sorted(set(assumed) - set(ASSUMED))
    if unknown:
        p.error(f"unknown assumed input(s) {unknown}; known: {sorted(ASSUMED)}")
    result = build(assumed)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in result["models"]:
        print(f"{row['model']}: {row['bytes_per_version'] / 1e9:,.0f} GB a version; "
              f"{row['rollout_gpus_per_learner_gpu']:.1f} rollout GPUs per learner GPU; "
              + ", ".join(f"{k} {v:,.1f} s" for k, v in row["propagation_sharded_s"].items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

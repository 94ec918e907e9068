"""The many-hosts sections of docs/results.md (experiments.results_page): how fast a version reaches the agents by
transport, what the trajectories' partition carries, and the capacity model built on those figures."""

from __future__ import annotations

from pathlib import Path

from experiments.results_format import RESULTS, Reader, cnt, sec, section, table

TRANSPORTS = ("directory", "http", "broadcast")


def mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def weights_table(w: dict) -> str:
    cells = {(r["size"], r["dtype"], r["agents"], r["transport"]): r["seconds"] for r in w["rows"]}
    keys = dict.fromkeys((r["size"], r["dtype"], r["agents"]) for r in w["rows"])
    rows = [[size, f"{w['models'][size]['params'] / 1e6:,.1f}M", dtype, mib(w["models"][size]["file_bytes"][dtype]),
             agents, *(f"{cells[(size, dtype, agents, t)]:.3f}" if (size, dtype, agents, t) in cells else "—"
                       for t in TRANSPORTS)] for size, dtype, agents in keys]
    return table(["model", "params", "dtype", "MiB a version", "agents", *(f"{t} (s)" for t in TRANSPORTS)], rows)


def partition_table(p: dict) -> str:
    rows = [[c["tokens"], c["producers"], c["flush_every"], cnt(c["produce_per_s"]), cnt(c["live_read"]["per_s"]),
             cnt(c["backlog_read"]["per_s"])] for c in p["cases"]]
    return table(["tokens", "producers", "flush every", "produced/s", "read live/s", "read from the start/s"], rows)


def encoding_table(e: dict) -> str:
    rows = [[c["tokens"], cnt(c["vocab"]), cnt(c["msgpack_lists"]["bytes"]), cnt(c["packed"]["bytes"]),
             f"{c['msgpack_lists']['encode_decode_us']:,.1f}", f"{c['packed']['encode_decode_us']:,.1f}"]
            for c in e["cases"]]
    return table(["tokens", "vocabulary", "msgpack bytes", "packed bytes", "msgpack encode+decode (µs)",
                  "packed encode+decode (µs)"], rows)


def hosts_table(c: dict, p: dict) -> str:
    def row(name: str, n: int, trained: float, steps: int, versions: dict) -> list:
        return [name, cnt(n), cnt(trained), f"{trained / n:.3f}", steps, f"{1000 * steps / n:.1f}",
                min(versions.values())]

    run, plain = c["pipeline"], p["learner"]
    rows = [row("three containers, no shared volume (tests/test_multihost.py), agents killed once",
                run["trajectories"], run["trained"], run["learner_steps"], run["versions_loaded"]),
            row("two directories, plain processes (docs/scale.md's commands)", p["rewards"]["trajectories"],
                plain["learner_counts_last"]["ok"], plain["steps"], p["versions_loaded"])]
    return table(["smoke scenario, 2 agents, versions over HTTP", "trajectories", "trained", "trained fraction",
                  "learner steps", "steps per 1,000 trajectories", "versions loaded per agent"], rows)


def transport_section(root: Path) -> str:
    get = Reader(root)
    w = get(RESULTS / "weights.json")
    p, e = get(RESULTS / "data_plane/trajectory_partition.json"), get(RESULTS / "data_plane/trajectory_encoding.json")
    hosts = hosts_table(get(RESULTS / "multihost/containers.json"), get(RESULTS / "multihost/plain_processes.json"))
    what = (f"A new version from the learner's publish call to the last agent process holding it (median of repeats, "
            f"`bench/weights.py`, {w['machine']['cpus']} cores, load {w['machine']['loadavg_1m']:.1f} at the start): "
            f"the shared directory, HTTP pull from the learner's weight server, and broadcast over a gloo group. Then "
            f"trajectories through the one partition of `<run>.trajectories` ({p['broker']} broker, load up to "
            f"{max(c['loadavg_1m'] for c in p['cases']):.0f}; demand of {p['demand']['agents']} agents: "
            f"{cnt(p['demand']['trajectories_per_s'])}/s), and a packed encoding against msgpack lists (not adopted: "
            "encoding from lists costs more than the bytes it saves). Last, the whole pipeline with agents on another "
            "host (trained fraction as the tap recorded it: the last partial batch is not trained).")
    return section("9. Weights across hosts and the data plane", what,
                   [weights_table(w), partition_table(p), encoding_table(e), hosts],
                   get.read + [RESULTS / "weights.png"], [])


def capacity_table(c: dict) -> str:
    links = c["assumed"]["link_gbit_s"]
    rows = [[m["model"], f"{m['bytes_per_version'] / 1e9:,.0f}", m["shards"],
             *(sec(m["propagation_sharded_s"][f"{t}@{g}"]) for t in TRANSPORTS for g in links),
             f"{m['rollout_gpus_per_learner_gpu']:.2f}", f"{m['trajectory_bytes_per_rollout_gpu_s'] / 1e6:,.2f}"]
            for m in c["models"]]
    return table(["model", "GB a version (bf16)", "shards", *(f"{t} {g} Gb/s (s)" for t in TRANSPORTS for g in links),
                  "rollout GPUs per learner GPU", "trajectory MB/s per rollout GPU"], rows)


def capacity_section(root: Path) -> str:
    get = Reader(root)
    c = get(RESULTS / "capacity.json")
    a, m = c["assumed"], c["measured"]
    cost = m["version_cpu_cost"]
    what = ("`python -m experiments.capacity` (the model: docs/scale.md). Measured inputs: CPU seconds per GB to "
            "publish and to verify and load a version, " + ", ".join(
                f"{t} {cost[t]['publish_s_per_gb']:.1f} + {cost[t]['load_s_per_gb']:.1f}" for t in TRANSPORTS)
            + f"; {m['wire_bytes_per_token']:.1f} bytes a token on the wire; the SAO step {m['sao_over_bare']:.3f}x "
            f"a bare forward+backward. Assumed: {a['agents']} agents, a shared filesystem of "
            f"{a['shared_fs_gbyte_s']:.0f} GB/s, {a['gpu_peak_tflops']:.0f} TFLOP/s a GPU at MFU "
            f"{a['mfu_train']:.2f} training and {a['mfu_generate']:.2f} generating, a critic "
            f"{a['value_params_fraction']:.1f}x the policy; propagation with the CPU path split over the shards.")
    return section("10. Capacity model", what, [capacity_table(c)], list(get.read), [])

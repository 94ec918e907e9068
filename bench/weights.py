"""Time to bring a new policy version to 1, 2 and 4 agents, by weight transport and model size (issue 46 item 5).

The learner's side runs here as `learner/train.py` builds it (the weight store, its weight server, the broadcast
sender with its rendezvous store); each agent is a process of its own (`python -m bench.weights_agent`, one torch
thread, a torch engine built from the model's directory) holding the three sources an agent can have: the store's
path (directory), the weight server (http, pulled in verified chunks) and the learner's group (broadcast, gloo over
loopback). For each model, dtype, agent count and transport, a version is published (the learner's publish call:
safetensors, sha256, manifest, and for broadcast the bucket copy and its digest) and announced to the agents at
once (no Kafka in between); the time is from the publish call to the last agent's engine holding the version
(`load_state_dict` done), the median of `--repeats`. Models: the tiny default policy (`ModelConfig()`), and a
~100M and a ~500M dense Qwen3 built here from a config with random weights (no hub). Bytes per version: the
tensors' bytes in fp32 and bf16 (a tied embedding once), and the safetensors file as published.

    python -m bench.weights [--quick] [--out runs/bench] [--sizes tiny,100m,500m] [--repeats N]

Writes OUT/weights.json and OUT/weights.png and prints the table. The 500M model runs in bf16 with 1 and 2 agents
only by default: four fp32 engines of it (1.9 GB each) plus the versions in flight do not fit beside the learner in
this machine's 23 GB (`--agents` overrides).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import torch

ROOT = Path(__file__).resolve().parents[1]
TRANSPORTS = ("directory", "http", "broadcast")
QWEN3 = {  # dense Qwen3 shapes giving ~100M and ~500M parameters (tied embeddings, a 32k vocabulary)
    "100m": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 2048, "num_attention_heads": 12,
             "num_key_value_heads": 4, "head_dim": 64},
    "500m": {"hidden_size": 1280, "num_hidden_layers": 24, "intermediate_size": 3456, "num_attention_heads": 16,
             "num_key_value_heads": 4, "head_dim": 80},
}
PLAN = {  # size -> (dtypes, agent counts, repeats)
    "tiny": (("float32", "bfloat16"), (1, 2, 4), 3),
    "100m": (("float32", "bfloat16"), (1, 2, 4), 2),
    "500m": (("bfloat16",), (1, 2), 1),
}
QUICK = {"tiny": (("float32", "bfloat16"), (1, 2), 1)}


def build_model(size: str, out: Path) -> torch.nn.Module:
    """The model (fp32) and its directory at `out` (config, weights, the embedded tokenizer for the engine)."""
    from learner.models import CharTokenizer, ModelConfig, build_policy, save_policy

    torch.manual_seed(0)
    if size == "tiny":
        model = build_policy(ModelConfig(), seed=0)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=2048,
                                             **QWEN3[size])).eval()
    save_policy(model, out, CharTokenizer())
    return model


def tensor_bytes(model: torch.nn.Module) -> dict[str, int]:
    from streamer.transport.weight_broadcast import distinct

    state = distinct(model.state_dict())
    return {"float32": sum(t.numel() * 4 for t in state.values()),
            "bfloat16": sum(t.numel() * 2 for t in state.values())}


class Agent:
    def __init__(self, store: Path, url: str, group: str, model_dir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.weights_agent", "--transport", "all", "--dir",
                                      str(store), "--url", url, "--group", group, "--engine", str(model_dir)],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def reply(self, timeout: float = 600.0) -> dict:
        got = self.lines.get(timeout=timeout)
        if got is None:
            raise RuntimeError(f"agent {self.proc.pid} exited ({self.proc.poll()})")
        return got

    def send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def close(self) -> int | None:
        """Its exit status (0: a clean exit at the end of its input)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def _wait(cond, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def measure_size(size: str, dtypes, counts, repeats: int, tmp: Path) -> tuple[dict, list[dict]]:
    from learner.trainer.publish import DirectoryPublisher
    from streamer.transport.weight_broadcast import Broadcaster
    from streamer.transport.weight_server import WeightServer

    t0 = time.perf_counter()
    model = build_model(size, tmp / size / "model")
    info = {"params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
            "tensor_bytes": tensor_bytes(model), "file_bytes": {}, "build_s": time.perf_counter() - t0}
    store = tmp / size / "store"
    server = WeightServer(store, "127.0.0.1:0").start()
    url = f"http://{server.address}"
    sender = Broadcaster("127.0.0.1:0", timeout_s=120.0).start()
    plain = DirectoryPublisher(store, keep=2, base_uri=url)
    broadcast = DirectoryPublisher(store, keep=2, base_uri=url, broadcast=sender.offer)
    agents = [Agent(store, url, sender.address, tmp / size / "model") for _ in range(max(counts))]
    rows, version = [], 0
    try:
        for a in agents:
            assert a.reply()["ready"]
        joined = 0
        for n in sorted(counts):
            for a in agents[joined:n]:  # the group grows with the agent count (the sender takes them in)
                a.send({"join": True})
                assert a.reply()["asked"]
            joined = n
            _wait(lambda n=n: len(sender.stats()["members"]) == n and sender.idle(), f"a group of {n}")
            for dtype in dtypes:
                model.to(getattr(torch, dtype))
                for transport in TRANSPORTS:
                    times, publish_s, loads, via = [], [], [], []
                    for _ in range(repeats):
                        with torch.no_grad():
                            for p in model.parameters():
                                p.add_(1e-3)  # a training step
                        version += 1
                        start = time.time()
                        pv = (broadcast if transport == "broadcast" else plain).publish(model, version, version)
                        publish_s.append(time.time() - start)
                        for a in agents[:n]:
                            a.send({"via": transport, "pv": msgspec.to_builtins(pv), "digest": False})
                        replies = [a.reply() for a in agents[:n]]
                        times.append(max(r["done_at"] for r in replies) - start)
                        loads += [r["seconds"] for r in replies]
                        via += [r["from"].startswith("broadcast") for r in replies]
                        assert all(r["version"] == version == r["engine_version"] for r in replies), replies
                        _wait(sender.idle, "the sender")
                    info["file_bytes"][dtype] = (store / f"v{version:06d}" / "model.safetensors").stat().st_size
                    rows.append({"size": size, "dtype": dtype, "agents": n, "transport": transport,
                                 "seconds": statistics.median(times), "all": times,
                                 "publish_s": statistics.median(publish_s), "agent_load_s": statistics.median(loads),
                                 "by_broadcast": sum(via) / len(via) if transport == "broadcast" else None})
                    print(f"  {size:>4} {dtype:<8} {n} agents {transport:<9} {rows[-1]['seconds']:7.3f} s "
                          f"(publish {rows[-1]['publish_s']:.3f} s)", flush=True)
        info["broadcast"] = sender.stats()
    finally:
        info["agents_exit"] = [a.close() for a in agents]
        sender.close()
        server.close()
    return info, rows


def table(result: dict) -> str:
    lines = ["| model | params | dtype | MiB/version | agents | directory s | http s | broadcast s |",
             "|---|---|---|---|---|---|---|---|"]
    cells = {(r["size"], r["dtype"], r["agents"], r["transport"]): r["seconds"] for r in result["rows"]}
    for size, info in result["models"].items():
        for dtype, n in sorted({(r["dtype"], r["agents"]) for r in result["rows"] if r["size"] == size},
                               key=lambda x: (x[0] != "float32", x[1])):
            times = [f"{cells[(size, dtype, n, t)]:.3f}" for t in TRANSPORTS]
            lines.append(f"| {size} | {info['params'] / 1e6:.1f}M | {dtype} | "
                         f"{info['tensor_bytes'][dtype] / 2**20:.1f} | {n} | " + " | ".join(times) + " |")
    return "\n".join(lines)


def figure(result: dict, path: Path) -> Path:
    from bench.common import pyplot, save_figure

    plt = pyplot()
    sizes = list(result["models"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 3.6), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for transport, color in zip(TRANSPORTS, ("tab:blue", "tab:orange", "tab:green")):
            for dtype, style in (("float32", "-"), ("bfloat16", "--")):
                key = (size, transport, dtype)
                rows = [r for r in result["rows"] if (r["size"], r["transport"], r["dtype"]) == key]
                if rows:
                    ax.plot([r["agents"] for r in rows], [r["seconds"] for r in rows], style, color=color, marker="o",
                            label=f"{transport} {dtype}")
        info = result["models"][size]
        ax.set_title(f"{size}: {info['params'] / 1e6:.0f}M params, {info['tensor_bytes']['bfloat16'] / 2**20:.0f} MiB "
                     f"bf16", fontsize=9)
        ax.set_xlabel("agents")
        ax.set_xticks(sorted({r["agents"] for r in result["rows"] if r["size"] == size}))
        ax.set_ylabel("publish call to the last engine holding it (s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    m, after = result["machine"], result.get("machine_after", result["machine"])
    return save_figure(fig, path, f"A new policy version to N agents (median; {m['cpus']} shared CPUs, load average "
                                  f"{m['loadavg_1m']} at the start, {after['loadavg_1m']} at the end)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the tiny model, 1 and 2 agents, one repeat (a smoke test)")
    p.add_argument("--sizes", default="", help="comma-separated, of tiny, 100m, 500m (default: all)")
    p.add_argument("--agents", default="", help="comma-separated agent counts (default: per size, see PLAN)")
    p.add_argument("--repeats", type=int, default=0, help="versions timed per cell (default: per size)")
    p.add_argument("--out", default="runs/bench", help="directory for weights.json and weights.png")
    a = p.parse_args(argv)
    from bench.common import git_commit, machine, save_json

    torch.set_num_threads(1)
    plan = dict(QUICK if a.quick else PLAN)
    if a.sizes:
        plan = {s: (PLAN | QUICK)[s] for s in a.sizes.split(",")}
    start_machine, t0 = machine(), time.time()
    result = {"bench": "weights", "mode": "quick" if a.quick else "full", "machine": start_machine,
              "commit": git_commit(), "command": " ".join(["python -m bench.weights", *(argv or sys.argv[1:])]),
              "settings": {"bucket_bytes": 64 * 2**20, "chunk_bytes": 4 * 2**20, "agent_threads": 1,
                           "learner_threads": 1, "transports": list(TRANSPORTS)},
              "models": {}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        for size, (dtypes, counts, repeats) in plan.items():
            counts = tuple(int(x) for x in a.agents.split(",")) if a.agents else counts
            print(f"{size}: {', '.join(dtypes)}, agents {counts}, {a.repeats or repeats} repeats", flush=True)
            info, rows = measure_size(size, dtypes, counts, a.repeats or repeats, Path(tmp))
            result["models"][size] = info
            result["rows"] += rows
    result["seconds"] = time.time() - t0
    result["machine_after"] = machine()
    out = Path(a.out)
    result["png"] = str(figure(result, out / "weights.png"))
    result["table"] = table(result)
    save_json(result, out / "weights.json")
    print(result["table"])
    print(f"{result['seconds']:.0f} s; load average {start_machine['loadavg_1m']} at the start, "
          f"{result['machine_after']['loadavg_1m']} at the end; {out / 'weights.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

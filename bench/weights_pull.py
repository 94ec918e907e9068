"""Time to bring one policy version into an agent's engine: the directory store against the HTTP pull.

The default tiny policy (`ModelConfig()`, ~3.4M parameters, fp32) is published once by the learner's publisher; then,
`--repeats` times each, one agent's `PolicyFollower` loads the announced version into a torch engine from the store
(`WeightStore`: read the file, sha256, safetensors) and from a weight server on localhost (`HttpWeightSource`:
manifest, chunks verified, whole file verified, safetensors from bytes). Prints each transport's median and range
(seconds, from the swap's start to the engine holding the weights) and, with --out, writes them as JSON.

    python -m bench.weights_pull [--repeats 7] [--chunk-mib 4] [--out bench.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def measure(repeats: int, chunk_bytes: int) -> dict:
    from learner.engines import make_engine
    from learner.models import CharTokenizer, ModelConfig, build_policy, save_policy
    from learner.trainer.publish import DirectoryPublisher
    from streamer.transport.memory_bus import MemoryBus
    from streamer.transport.weight_client import HttpWeightSource
    from streamer.transport.weight_server import WeightServer
    from streamer.transport.weights import Announcer, PolicyFollower, WeightStore
    from streamer.wire.schema import PolicyVersion
    from streamer.wire.topics import Topics

    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init"
        model = build_policy(ModelConfig(), seed=0)
        save_policy(model, init, CharTokenizer())
        params = sum(p.numel() for p in model.parameters())
        server = WeightServer(Path(tmp) / "store", "127.0.0.1:0").start()
        url = f"http://{server.address}"
        sources = {"directory": WeightStore(Path(tmp) / "store"), "http": HttpWeightSource(url)}
        out: dict = {"params": params, "chunk_bytes": chunk_bytes, "repeats": repeats, "seconds": {}}
        try:
            bus, run = MemoryBus(), "bench"
            publisher = DirectoryPublisher(Path(tmp) / "store", Announcer(bus.producer(), run), chunk_bytes=chunk_bytes,
                                           base_uri=url)
            pv = publisher.publish(model, 1, 1)
            out["bytes"] = (publisher.store.path_of(1) / "model.safetensors").stat().st_size
            engine = make_engine("torch", init)
            for name, source in sources.items():
                times = []
                for _ in range(repeats):
                    follower = PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), source)
                    follower.poll()  # the announcement is read before the clock starts
                    engine.version = 0
                    t0 = time.perf_counter()
                    assert follower.maybe_swap(engine) and engine.version == pv.version, follower.refused
                    times.append(time.perf_counter() - t0)
                out["seconds"][name] = {"median": statistics.median(times), "min": min(times), "max": max(times),
                                        "all": times}
        finally:
            server.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weights_pull", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--chunk-mib", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (an agent runs with 1)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    r = measure(a.repeats, int(a.chunk_mib * 1024 * 1024))
    print(f"{r['params'] / 1e6:.2f}M parameters, {r['bytes'] / 2**20:.1f} MiB per version, chunks of "
          f"{r['chunk_bytes'] / 2**20:g} MiB, {r['repeats']} repeats")
    for name, s in r["seconds"].items():
        print(f"  {name:<9} median {1000 * s['median']:7.1f} ms "
              f"(min {1000 * s['min']:.1f}, max {1000 * s['max']:.1f})")
    if a.out:
        from bench.common import machine, save_json

        save_json({**r, "machine": machine()}, Path(a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

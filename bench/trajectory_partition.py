"""Trajectories per second through `<run>.trajectories`' one partition: P agent-like producer processes against the
learner's one reader, beside what P agents produce.

    .venv/bin/python -m bench.trajectory_partition [--producers 8] [--n 16000] [--tokens 256 2048] [--bootstrap H:P]

Each producer is a process with the project's producer (`KafkaBus.producer()`: acks=all, idempotent, lz4, linger
5 ms) sending pre-built trajectories keyed by task id and flushing every `--flush-every` records, as an agent
flushes after each finished task (1: one task at a time, the slowest; 8: `concurrency` 8). Meanwhile one reader,
the learner's (`KafkaBus.consumer`, no group, decoding and validating each record), reads them as they come
("live"); then a fresh reader reads the whole topic from the start, as the learner does after a restart
("backlog"). The agents' demand is their measured rollout rate (docs/results/components/transport.json: the tiny
policy, one thread) times P. Writes runs/bench/trajectory_partition.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import git_commit, machine, save_json

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT_JSON = ROOT / "docs" / "results" / "components" / "transport.json"


def _producer(bootstrap: str, topic: str, n: int, tokens: int, seed: int, flush_every: int, ready, go, out) -> None:
    from bench.transport import make_trajectories
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.schema import encode

    raws = []  # encoded in chunks: n trajectories of 2048 tokens as Python lists would take gigabytes
    for chunk in range(0, n, 100):
        for i, t in enumerate(make_trajectories(min(100, n - chunk), tokens, tokens // 8, seed * 100_003 + chunk)):
            t.task_id = f"p{seed}-{chunk + i}"
            raws.append((encode(t), t.task_id.encode()))
    prod = KafkaBus(bootstrap).producer()
    prod.send_raw(topic, raws[0][0], raws[0][1])  # connection and metadata before the clock starts
    prod.flush()
    ready.put(seed)
    go.wait()
    t0 = time.time()
    for i, (raw, key) in enumerate(raws[1:], 1):
        prod.send_raw(topic, raw, key)
        if i % flush_every == 0:
            prod.flush()
    prod.flush()
    out.put((seed, t0, time.time(), len(raws)))
    prod.close()


def _read(bootstrap: str, topic: str, n: int, timeout_s: float, procs=()) -> tuple[int, float, float]:
    """(records, time the reader was created, last record time) for the learner's reader of the topic; it gives up
    5 s after the last producer of `procs` exited with records missing."""
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.schema import Trajectory

    created = time.time()
    cons = KafkaBus(bootstrap).consumer({topic: Trajectory})
    got, last = 0, 0.0
    deadline = time.monotonic() + timeout_s
    try:
        while got < n and time.monotonic() < deadline:
            batch = cons.poll(5000, 0.5)
            if batch:
                last = time.time()
                got += len(batch)
            elif procs and not any(p.is_alive() for p in procs) and time.time() - max(last, created) > 5:
                raise RuntimeError(f"{topic}: {got} of {n} records; producers exited "
                                   f"{[p.exitcode for p in procs]}")
    finally:
        cons.close()
    return got, created, last


def run_case(bootstrap: str, producers: int, per_producer: int, tokens: int, flush_every: int) -> dict:
    from streamer.transport.kafka_bus import KafkaBus
    from streamer.wire.topics import Topics, partitions_by_topic

    run = f"bp{os.getpid()}t{tokens}f{flush_every}"
    topic = Topics(run).trajectories
    KafkaBus(bootstrap).create_topics(partitions_by_topic(run))
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_producer, args=(bootstrap, topic, per_producer, tokens, i, flush_every, ready, go,
                                                 out)) for i in range(producers)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    n = producers * per_producer
    go.set()
    got, _, last = _read(bootstrap, topic, n, timeout_s=600, procs=procs)
    done = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    start, end = min(d[1] for d in done), max(d[2] for d in done)
    sent = sum(d[3] - 1 for d in done)
    b_got, b_created, b_last = _read(bootstrap, topic, n, timeout_s=600)
    return {"tokens": tokens, "producers": producers, "flush_every": flush_every, "records": n,
            "produce_per_s": sent / (end - start), "per_producer_per_s": sent / (end - start) / producers,
            "live_read": {"records": got, "per_s": got / max(1e-9, last - start),
                          "lag_after_producers_s": last - end},
            # from the reader's creation (metadata, assignment) to its last record: a learner's restart
            "backlog_read": {"records": b_got, "seconds": b_last - b_created,
                             "per_s": b_got / max(1e-9, b_last - b_created)},
            "loadavg_1m": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--n", type=int, default=16000, help="trajectories per case (all producers together)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--flush-every", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--bootstrap", default=None, help="an existing broker (default: start the embedded one)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench" / "trajectory_partition.json"))
    a = ap.parse_args(argv)
    from streamer.transport.broker import EmbeddedBroker
    from streamer.wire.settings import BrokerSettings

    work = Path(tempfile.mkdtemp(prefix="sao-bench-partition-"))
    broker = None if a.bootstrap else EmbeddedBroker(BrokerSettings(port=0, log_path=str(work / "b.log"))).start()
    bootstrap = a.bootstrap or broker.bootstrap
    cases = []
    try:
        for tokens in a.tokens:
            for fe in a.flush_every:
                c = run_case(bootstrap, a.producers, a.n // a.producers, tokens, fe)
                cases.append(c)
                print(f"{tokens:5d} tokens, {a.producers} producers flushing every {fe}: produced "
                      f"{c['produce_per_s']:8.0f}/s ({c['per_producer_per_s']:.0f}/s each); learner's reader live "
                      f"{c['live_read']['per_s']:8.0f}/s (done {c['live_read']['lag_after_producers_s']:.2f} s after "
                      f"the producers), backlog {c['backlog_read']['per_s']:8.0f}/s", flush=True)
    finally:
        if broker is not None:
            broker.stop()
    rollout_ms = json.loads(ROLLOUT_JSON.read_text())["agent_rollout"]["median_ms"]
    demand = a.producers * 1000.0 / rollout_ms
    ceiling = min(min(c["produce_per_s"], c["live_read"]["per_s"]) for c in cases if c["tokens"] == min(a.tokens))
    res = {"what": __doc__.splitlines()[0], "commit": git_commit(), "machine": machine(), "time": time.time(),
           "broker": "external" if a.bootstrap else "embedded tansu", "partitions": 1, "cases": cases,
           "demand": {"agents": a.producers, "rollout_ms_per_trajectory": rollout_ms,
                      "source": str(ROLLOUT_JSON.relative_to(ROOT)), "trajectories_per_s": demand},
           "headroom_at_smallest_tokens": ceiling / demand}
    print(f"demand: {a.producers} agents x 1 trajectory / {rollout_ms:.1f} ms = {demand:.0f}/s; one partition "
          f"carries >= {ceiling:.0f}/s at {min(a.tokens)} tokens: {ceiling / demand:.0f}x headroom")
    print("->", save_json(res, Path(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

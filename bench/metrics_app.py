"""Throughput of the faust metrics app (`sao metrics`): trajectories/s folded into windowed metrics.

On the embedded broker: N trajectories (256 tokens each by default, event times 1 ms apart, four
families) are produced first, then `sao metrics` starts as a child process and the bench reads
`<run>.metrics` until the total-level `metrics/reward` point reports all N trajectories.
Reported: produce time, time from the app's start to its first point and to the last one (faust's
start and group join included), the overall rate N / (last - start), and the steady rate between
the points that report 10% and 90% of N (start-up excluded). Saves runs/bench/metrics_app.json.

    .venv/bin/python bench/metrics_app.py [--n 20000] [--tokens 256] [--window 1]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from streamer.transport.broker import EmbeddedBroker
from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.schema import MetricPoint, Trajectory
from streamer.wire.settings import BrokerSettings
from streamer.wire.topics import Topics, partitions_by_topic

FAMILIES = ("arith", "tool", "format", "string")
EVENT_T0 = 1_700_000_000.0  # event times in the past: the app's idle flush closes the last window


def trajectory(i: int, tokens: int, prompt: int = 32) -> Trajectory:
    return Trajectory(traj_id=str(i), task_id=str(i), family=FAMILIES[i % 4], concept=f"c{i % 3}", prompt_len=prompt,
                      tokens=list(range(tokens)), loss_mask=[0] * prompt + [1] * (tokens - prompt),
                      logprobs=[-0.5] * tokens, reward=float(i % 2), success=bool(i % 2), policy_version=0,
                      finished_at=EVENT_T0 + i * 0.001)


def produce(bus: KafkaBus, topic: str, n: int, tokens: int) -> float:
    prod = bus.producer()
    t0 = time.perf_counter()
    for i in range(n):
        prod.send(topic, trajectory(i, tokens), key=str(i))
    prod.flush()
    elapsed = time.perf_counter() - t0
    prod.close()
    return elapsed


def watch(bus: KafkaBus, topic: str, n: int, timeout_s: float, started: float) -> list[tuple[float, int]]:
    """(seconds since `started`, trajectories counted) of each total-level reward point, until all n."""
    cons = bus.consumer({topic: MetricPoint})
    seen: list[tuple[float, int]] = []
    try:
        while time.perf_counter() - started < timeout_s and (not seen or seen[-1][1] < n):
            for m in cons.poll(max_records=1000, timeout=0.5):
                p = m.msg
                if p.name == "metrics/reward" and not p.labels:
                    seen.append((time.perf_counter() - started, max(p.trajectories, seen[-1][1] if seen else 0)))
    finally:
        cons.close()
    return seen


def rates(seen: list[tuple[float, int]], n: int) -> dict[str, float | int | None]:
    if not seen:
        return {"counted": 0, "first_point_s": None, "all_points_s": None, "overall_traj_per_s": None,
                "steady_traj_per_s": None}
    lo = next((p for p in seen if p[1] >= 0.1 * n), None)
    hi = next((p for p in seen if p[1] >= 0.9 * n), None)
    steady = (hi[1] - lo[1]) / (hi[0] - lo[0]) if lo and hi and hi[0] > lo[0] else None
    done = seen[-1]
    return {"counted": done[1], "first_point_s": round(seen[0][0], 2), "all_points_s": round(done[0], 2),
            "overall_traj_per_s": round(done[1] / done[0]) if done[1] >= n else None,
            "steady_traj_per_s": round(steady) if steady else None}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="trajectories")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per trajectory")
    ap.add_argument("--window", type=float, default=1.0, help="metrics window (s of event time; 1 ms per trajectory)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default="runs/bench/metrics_app.json")
    args = ap.parse_args(argv)
    run = "bench"
    topics = Topics(run)
    with EmbeddedBroker(BrokerSettings(port=0)) as broker:
        bus = KafkaBus(broker.bootstrap)
        bus.create_topics(partitions_by_topic(run))
        produce_s = produce(bus, topics.trajectories, args.n, args.tokens)
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", "metrics",
                                 "--bootstrap", broker.bootstrap,
                                 "--run", run, "--window", str(args.window), "--set", "lateness_s=5",
                                 "--set", "idle_flush_s=1"])
        try:
            seen = watch(bus, topics.metrics, args.n, args.timeout, started)
        finally:
            stop(proc)
    result = {"n": args.n, "tokens": args.tokens, "window_s": args.window, "produce_s": round(produce_s, 2),
              **rates(seen, args.n)}
    print(json.dumps(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    return 0 if result["counted"] >= args.n else 1


if __name__ == "__main__":
    raise SystemExit(main())

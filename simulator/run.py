"""`sao simulate`: generate a scenario's task stream into a sink (file, queue or Kafka).

    sao simulate --scenario default --out tasks.jsonl [--seed 1] [--limit N] [--realtime] [--set rate=5]
    sao simulate --bootstrap 127.0.0.1:9092 --run exp1 --max-lag 96 [--group exp1.agents]

`--max-lag N` (Kafka only): back-pressure, so a drift reaches every agent at one moment. The simulator
publishes only while fewer than N tasks are unanswered by the agents' consumer group (streamer.transport.backpressure;
`streamer.transport.backpressure.default_max_lag` derives N from the agents' settings). 0: publish as fast as it can.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from simulator.generator import generate
from simulator.scenario import Scenario, ScenarioError, load_scenario
from simulator.sinks import TaskSink, file_sink
from streamer.wire.config import ConfigError, read_yaml
from streamer.wire.schema import DriftEvent


def simulate(scn: Scenario, sink: TaskSink, seed: int | None = None, limit: int | None = None,
             realtime: bool = False, t0: float | None = None) -> dict[str, int]:
    """Write the stream to `sink` (closing it); with `realtime`, each message waits for its timestamp."""
    t0 = time.time() if t0 is None else t0
    counts = {"tasks": 0, "drift_events": 0}
    try:
        for msg in generate(scn, seed=seed, t0=t0, limit=limit):
            stamp = msg.time if isinstance(msg, DriftEvent) else msg.created_at
            wait = stamp - time.time()
            if realtime and scn.rate > 0 and wait > 0:
                time.sleep(wait)  # one reading of the clock: a second one could make the wait negative
            if isinstance(msg, DriftEvent):
                sink.write_drift(msg)
                counts["drift_events"] += 1
            else:
                sink.write(msg)
                counts["tasks"] += 1
    finally:
        sink.close()
    return counts


def kafka_sink(bootstrap: str, run: str, max_lag: int = 0, group: str = "") -> TaskSink:
    from streamer.transport.sinks import KafkaTaskSink  # only when asked: needs the Kafka clients

    group = group or f"{run}.agents"
    if max_lag > 0:
        print(f"sao simulate: back-pressure: at most {max_lag} tasks of {run}.tasks ahead of what consumer group "
              f"{group} has committed", file=sys.stderr, flush=True)
    else:
        print(f"sao simulate: no back-pressure (--max-lag 0): publishing {run}.tasks as fast as possible",
              file=sys.stderr, flush=True)
    return KafkaTaskSink(bootstrap=bootstrap, run=run, max_lag=max_lag, group=group)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sao simulate", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="default", help="YAML file, or a name under simulator/scenarios/")
    p.add_argument("--out", help="output file: .jsonl, .parquet or .csv")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers: publish to <run>.tasks instead of a file")
    p.add_argument("--run", default="sao", help="run name (topic prefix) with --bootstrap")
    p.add_argument("--seed", type=int, default=None, help="default: the scenario's seed")
    p.add_argument("--limit", type=int, default=None, help="stop after this many tasks")
    p.add_argument("--realtime", action="store_true", help="publish each task at its timestamp (rate)")
    p.add_argument("--max-lag", type=int, default=0, metavar="N",
                   help="with --bootstrap: publish only while fewer than N tasks are uncommitted by --group "
                        "(0: no back-pressure; file sinks ignore it)")
    p.add_argument("--group", default="", help="consumer group whose commits --max-lag watches (default <run>.agents)")
    p.add_argument("--run-config", metavar="FILE",
                   help="a run's config.yaml (`sao up --prepare`): its scenario, seed and derived back-pressure "
                        "bound (launch section) replace --scenario, --seed and --max-lag")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario field")
    args = p.parse_args(argv)
    if args.run_config:
        try:
            launch = read_yaml(args.run_config, "launch")
        except ConfigError as e:
            p.error(str(e))
        args.scenario, args.max_lag = launch.get("scenario", args.scenario), int(launch.get("max_lag", args.max_lag))
        args.seed = launch["seed"] if launch.get("seed", -1) >= 0 else args.seed
    if bool(args.out) == bool(args.bootstrap):
        p.error("give exactly one of --out FILE, --bootstrap SERVERS")
    if args.max_lag < 0:
        p.error(f"--max-lag {args.max_lag}: must be >= 0 (0: no back-pressure)"
                + (f"; {args.run_config} was not written by `sao up --prepare`" if args.run_config else ""))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        scn = load_scenario(args.scenario, args.set)
    except ScenarioError as e:
        print(f"sao simulate: {e}", file=sys.stderr)
        return 2
    sink = kafka_sink(args.bootstrap, args.run, args.max_lag, args.group) if args.bootstrap else file_sink(args.out)
    t = time.perf_counter()
    counts = simulate(scn, sink, seed=args.seed, limit=args.limit, realtime=args.realtime)
    counts["seconds"] = round(time.perf_counter() - t, 3)
    gate = getattr(sink, "gate", None)
    if gate is not None:
        counts.update(max_lag=gate.max_lag, waited_s=round(gate.waited_s, 3))
    print(json.dumps({"scenario": scn.name, "out": args.out or f"{args.run}.tasks", **counts}))
    return 0

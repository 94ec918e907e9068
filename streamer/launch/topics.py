"""`sao topics`: create a run's topics with the project's partition counts, as soon as the broker answers.

The compose file's one-shot `topics` service runs it, so partition counts have one source
(`streamer.wire.topics.partitions_by_topic`) and nothing depends on a broker image's own scripts: it works
against Apache Kafka, the embedded Tansu broker or a managed cluster ($SAO_KAFKA_* security settings).
`--agents N` gives `<run>.tasks` at least N partitions (one per agent); the run file's `agent` section (or
`--set topics.replication_factor=3`, `--set client.max_message_bytes=...`) sets the replication factor and the
topics' maximum message size (`streamer.transport.kafka_bus.topic_configs`).

    sao topics [--bootstrap HOST:PORT] [--run NAME] [--agents N] [--config RUN.yaml] [--set KEY=VALUE] [--wait S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from streamer.wire.config import add_config_args, load_config
from streamer.wire.settings import AgentSettings
from streamer.wire.topics import check_run, partitions_by_topic


def create_when_ready(bootstrap: str | None, run: str, wait_s: float, log=print, agents: int = 0,
                      settings: AgentSettings | None = None) -> list[str]:
    """Create the run's missing topics, retrying once a second until the broker answers or `wait_s` passes."""
    from kafka.errors import KafkaError

    from streamer.transport.kafka_bus import KafkaBus

    s = settings or AgentSettings()
    bus = KafkaBus(bootstrap or None, s.client)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return bus.create_topics(partitions_by_topic(run, s.topics, agents), s.topics.replication_factor)
        except (KafkaError, OSError) as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no broker answered at {bus.bootstrap} within {wait_s:.0f} s ({e!r})") from None
            log(f"sao topics: waiting for the broker at {bus.bootstrap} ({type(e).__name__})")
            time.sleep(1.0)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sao topics", description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default="", help="Kafka bootstrap servers (default: $SAO_BOOTSTRAP)")
    p.add_argument("--run", default=os.environ.get("SAO_RUN", "demo"), help="run name = topic prefix ($SAO_RUN)")
    p.add_argument("--agents", type=int, default=0, help="agents of the run: <run>.tasks gets at least this many "
                                                         "partitions (default 0: topics.tasks_partitions)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the broker (default 120)")
    add_config_args(p, "AgentSettings", "topics.replication_factor=3")
    args = p.parse_args(argv)
    try:
        check_run(args.run)
        s = load_config(AgentSettings, args.config, args.overrides, section="agent")
        created = create_when_ready(args.bootstrap, args.run, args.wait, agents=args.agents, settings=s)
    except (ValueError, TimeoutError) as e:  # ConfigError is a ValueError
        print(f"sao topics: {e}", file=sys.stderr)
        return 1
    counts = partitions_by_topic(args.run, s.topics, args.agents)
    print("sao topics: " + ", ".join(f"{t} ({counts[t]} partition{'s' if counts[t] > 1 else ''}"
                                     f"{', created' if t in created else ''})" for t in counts)
          + f"; replication {s.topics.replication_factor}", flush=True)
    return 0


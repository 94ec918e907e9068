"""`sao topics`: create a run's topics with the project's partition counts, as soon as the broker answers.

The compose file's one-shot `topics` service runs it, so partition counts have one source
(`streamer.wire.topics.partitions_by_topic`) and nothing depends on a broker image's own scripts: it works
against Apache Kafka, the embedded Tansu broker or a managed cluster ($SAO_KAFKA_* security settings).

    sao topics [--bootstrap HOST:PORT] [--run NAME] [--wait SECONDS]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from streamer.wire.topics import check_run, partitions_by_topic


def create_when_ready(bootstrap: str | None, run: str, wait_s: float, log=print) -> list[str]:
    """Create the run's missing topics, retrying once a second until the broker answers or `wait_s` passes."""
    from kafka.errors import KafkaError

    from streamer.transport.kafka_bus import KafkaBus

    bus = KafkaBus(bootstrap or None)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return bus.create_topics(partitions_by_topic(run))
        except (KafkaError, OSError) as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no broker answered at {bus.bootstrap} within {wait_s:.0f} s ({e!r})") from None
            log(f"sao topics: waiting for the broker at {bus.bootstrap} ({type(e).__name__})")
            time.sleep(1.0)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sao topics", description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default="", help="Kafka bootstrap servers (default: $SAO_BOOTSTRAP)")
    p.add_argument("--run", default=os.environ.get("SAO_RUN", "demo"), help="run name = topic prefix ($SAO_RUN)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the broker (default 120)")
    args = p.parse_args(argv)
    try:
        check_run(args.run)
        created = create_when_ready(args.bootstrap, args.run, args.wait)
    except (ValueError, TimeoutError) as e:
        print(f"sao topics: {e}", file=sys.stderr)
        return 1
    counts = partitions_by_topic(args.run)
    print("sao topics: " + ", ".join(f"{t} ({counts[t]} partition{'s' if counts[t] > 1 else ''}"
                                     f"{', created' if t in created else ''})" for t in counts), flush=True)
    return 0

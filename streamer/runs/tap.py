"""`sao tap`: record a run's trajectories, drift events and metric points into its run directory.

    sao tap --bootstrap 127.0.0.1:9092 --run exp1 --run-dir runs/exp1

Reads `<run>.tasks` (counted only), `<run>.trajectories`, `<run>.drift`, `<run>.metrics` and
`<run>.learner` (progress only: the learner writes its own table) from the start, with no consumer
group and no commits, and writes them with `streamer.runs.artifacts.RunWriter`; a bounded sample of the
answers, as text, goes to samples.jsonl (`streamer.runs.samples`, decoded with the tokenizer `sao up` hands in).
`sao up` runs a `Tap` in a thread and reads its counters for the progress line. On SIGINT/SIGTERM it flushes, compacts
and writes `summary.json`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections import deque

from streamer.runs.artifacts import RunWriter
from streamer.runs.samples import AnswerSampler, Decode, SampleSettings
from streamer.wire.schema import (
    DeadLetter,
    DriftEvent,
    LearnerEvent,
    MetricPoint,
    SchemaError,
    Task,
    Trajectory,
    decode,
)
from streamer.wire.settings import ClientSettings
from streamer.wire.topics import Topics

log = logging.getLogger("streamer.runs.tap")
TAP_CONSUMER = "sao-tap"  # its client id, and the `consumer` of its dead letters


class Tap:
    """Consumes a run's topics into a RunWriter and keeps progress counters."""

    def __init__(self, consumer, writer: RunWriter, window: int = 200, sampler: AnswerSampler | None = None) -> None:
        self.consumer, self.writer, self.sampler = consumer, writer, sampler
        self.tasks = 0
        self.task_ids: set[str] = set()  # tasks answered (de-duplicated)
        self.given_up: set[str] = set()  # tasks an agent dead-lettered (it could not run or score them)
        self.trajectories = 0
        self.recent_rewards: deque[float] = deque(maxlen=window)
        self.concept_rewards: dict[tuple[str, str], deque[float]] = {}  # (family, concept) -> last 64 rewards
        self.latest_concept: dict[str, str] = {}  # family -> the concept of its newest trajectory
        self.drifts = 0
        self.learner: LearnerEvent | None = None
        self._stop = threading.Event()

    def handle(self, msg) -> None:
        if isinstance(msg, Trajectory):
            self.writer.trajectory(msg)
            self.trajectories += 1
            self.task_ids.add(msg.task_id)
            self.recent_rewards.append(msg.reward)
            self.concept_rewards.setdefault((msg.family, msg.concept), deque(maxlen=64)).append(msg.reward)
            self.latest_concept[msg.family] = msg.concept
            if self.sampler is not None:
                self.sampler.add(msg)
        elif isinstance(msg, Task):
            self.tasks += 1
        elif isinstance(msg, DriftEvent):
            self.writer.drift(msg)
            self.drifts += 1
        elif isinstance(msg, MetricPoint):
            self.writer.metric(msg)
        elif isinstance(msg, LearnerEvent):
            self.learner = msg
        elif isinstance(msg, DeadLetter) and msg.expected == "Task":
            try:  # a task an agent gave up on holds the whole task; a record nobody could decode does not count
                self.given_up.add(decode(msg.value, Task).task_id)
            except SchemaError:
                pass

    @property
    def accounted(self) -> int:
        """Tasks answered or dead-lettered by an agent: either way, no agent will take them again."""
        return len(self.task_ids | self.given_up)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self.consumer.poll(max_records=1000, timeout=0.5)
            except Exception:
                if self._stop.is_set():  # the run is stopping, its broker perhaps gone: nothing more to record
                    return
                raise
            for polled in batch:
                self.handle(polled.msg)
            self.writer.maybe_flush()
            if self.sampler is not None:
                self.sampler.maybe_flush()

    def stop(self) -> None:
        self._stop.set()

    @property
    def mean_reward(self) -> float:
        return sum(self.recent_rewards) / len(self.recent_rewards) if self.recent_rewards else float("nan")

    def concept_means(self) -> dict[str, float]:
        """'family/concept' -> mean reward of its last 64 trajectories, for each family's newest concept."""
        out = {}
        for fam, con in sorted(self.latest_concept.items()):
            r = self.concept_rewards[(fam, con)]
            out[f"{fam}/{con}"] = sum(r) / len(r)
        return out


def open_tap(bootstrap: str | None, run: str, run_dir: str, config: dict | None = None, decode: Decode | None = None,
             samples: SampleSettings | None = None) -> Tap:
    """A tap of `run`'s topics into `run_dir`; `decode` (the run's tokenizer) turns the sampled answers into text."""
    from streamer.transport.kafka_bus import KafkaBus

    t = Topics(run)
    types = {t.tasks: Task, t.trajectories: Trajectory, t.drift: DriftEvent, t.metrics: MetricPoint,
             t.learner: LearnerEvent, t.dlq: DeadLetter}
    # its dead letters carry its own consumer name: the learner reads <run>.trajectories too, and a record both
    # reject must be two letters (each consumer skips only its own letters when it reads the topic again)
    bus = KafkaBus(bootstrap, ClientSettings(client_id=TAP_CONSUMER))
    consumer = bus.consumer(types, group_id=None, dlq=t.dlq)
    return Tap(consumer, RunWriter(run_dir, config=config, writer_id="tap"),
               sampler=AnswerSampler(run_dir, samples or SampleSettings(), decode))


def close_tap(tap: Tap, summary: bool = True) -> None:
    tap.consumer.close()
    if tap.sampler is not None:
        tap.sampler.flush()
    tap.writer.close(summary=summary)


def main(argv: list[str], load_tokenizer=None) -> int:
    ap = argparse.ArgumentParser(prog="sao tap", description=__doc__.split("\n")[0])
    ap.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: $SAO_BOOTSTRAP)")
    ap.add_argument("--run", required=True, help="run name (topic prefix)")
    ap.add_argument("--run-dir", required=True, help="run directory to write")
    ap.add_argument("--no-summary", action="store_true", help="do not write summary.json at the end")
    ap.add_argument("--samples-keep", type=int, default=SampleSettings.keep,
                    help="answers kept per (family, concept, phase) in samples.jsonl: the first K and the latest K")
    ap.add_argument("--model", default=None, help="the run's model directory: its tokenizer writes the sampled answers "
                    "as text (without it samples.jsonl holds rewards and ids only)")
    args = ap.parse_args(argv)
    decode = load_tokenizer(args.model).decode if args.model and load_tokenizer else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tap %(levelname)s %(message)s")
    tap = open_tap(args.bootstrap, args.run, args.run_dir, decode=decode,
                   samples=SampleSettings(keep=args.samples_keep))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: tap.stop())
    tap.run()
    close_tap(tap, summary=not args.no_summary)
    log.info("recorded %d trajectories of %d tasks into %s (dead letters: %d)",
             tap.trajectories, tap.tasks, args.run_dir, tap.consumer.dead_letters)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

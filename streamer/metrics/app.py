"""The faust metrics app: `<run>.trajectories` + `<run>.learner` -> windowed `MetricPoint`s on `<run>.metrics`.

Values travel as raw bytes and are decoded with msgspec (`streamer.wire.schema.decode`, which checks their meaning
too: finite, bounded rewards, masks in {0, 1}, log-probs <= 0, a sane temperature and group size), never with
faust's codecs. Bad messages go to `<run>.dlq` as a `streamer.wire.schema.DeadLetter` (reason + original
bytes) and are counted (`metrics/dlq`), once per record: the app reads its own letters (consumer `metrics-app`)
when it starts, so records it reads again after a restart are not dead-lettered twice. A trajectory's policy
version is not bounded here (the learner bounds it): the learner's events can arrive after the trajectories its
new versions generated, and a version ahead of the learner's only counts as staleness 0.
The aggregation lives in `streamer.metrics.windows` (pure); `MetricsState` joins it to the learner version
(no I/O); `build_app` wires both to faust.
At-least-once processing (faust's exactly-once needs idempotent producers, which Tansu lacks).
One worker per run: every window is then complete in one process (see windows.py for why the
windows are our own rather than faust's windowed tables). Open windows live in memory: a restart
resumes from the committed offsets, so the windows open at the time of a crash come out partial.

Points on `<run>.metrics`: per closed window the metrics of `streamer.metrics.windows` (labels
{family, concept}, {family}, {}); `metrics/learner_version` per learner event; cumulative
`metrics/dlq` per rejected message and `metrics/late` with every batch of closed windows.

    sao metrics --bootstrap 127.0.0.1:9092 --run demo --window 5
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from streamer.metrics.windows import ClosedWindow, TumblingWindows, observe, window_points
from streamer.transport.bus import DLQ_MAX_VALUE_BYTES
from streamer.wire.config import ConfigError, add_config_args, load_config
from streamer.wire.schema import DeadLetter, LearnerEvent, MetricPoint, SchemaError, Trajectory, decode, encode
from streamer.wire.topics import Topics, check_run, partitions_by_topic

log = logging.getLogger("sao.metrics")

RUN_ENV = "SAO_RUN"
CONSUMER = "metrics-app"  # the `consumer` of its dead letters
Where = tuple[str, int, int]  # (topic, partition, offset) of a record


@dataclass
class MetricsSettings:
    run: str = "sao"  # topic prefix (the same default as `sao simulate` and `sao learn`)
    bootstrap: str = ""  # "" -> $SAO_BOOTSTRAP -> 127.0.0.1:9092
    window_s: float = 5.0  # tumbling window length (event time: Trajectory.finished_at)
    lateness_s: float = 1.0  # a window closes once a trajectory this much past its end arrives
    idle_flush_s: float = 3.0  # ... or, after this long without trajectories, once the wall clock passes it
    tick_s: float = 0.5  # how often the idle check runs
    app_id: str = ""  # faust app id = consumer group; "" -> "<run>.metrics-app"
    max_message_bytes: int = 4 * 1024 * 1024  # larger values go to the DLQ
    max_clock_skew_s: float = 300.0  # a trajectory that finished further ahead of this clock goes to the DLQ
    commit_interval_s: float = 2.8  # how often processed offsets are committed (faust's broker_commit_interval)
    web_port: int = 0  # faust's web server; 0: off (several workers may share a machine)
    web_host: str = "127.0.0.1"  # where faust's web server binds when on (faust's own default: every interface)
    loglevel: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "WARNING"

    def validate(self) -> None:
        if not self.window_s > 0:
            raise ConfigError("MetricsSettings.window_s: must be > 0 seconds")
        if self.max_clock_skew_s < 0:
            raise ConfigError("MetricsSettings.max_clock_skew_s: must be >= 0 seconds")
        if self.lateness_s < 0 or self.idle_flush_s <= 0 or self.tick_s <= 0 or self.commit_interval_s <= 0:
            raise ConfigError("MetricsSettings.lateness_s >= 0, idle_flush_s > 0, tick_s > 0 and commit_interval_s > 0 "
                              "are required")
        try:
            check_run(self.run)
        except ValueError as e:
            raise ConfigError(f"MetricsSettings.run: {e}") from None


def dead_letter(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                reason: str, expected: str) -> bytes:
    """The DLQ record every consumer of the project writes (`streamer.wire.schema.DeadLetter`), msgpack-encoded."""
    value = value or b""
    return encode(DeadLetter(topic=topic, partition=partition, offset=offset, key=key,
                             value=value[:DLQ_MAX_VALUE_BYTES], value_len=len(value), reason=reason,
                             expected=expected, consumer=CONSUMER, time=time.time()))


@dataclass
class MetricsState:
    """Everything the app knows; each method returns what to publish. No I/O.

    `lettered`: the records already dead-lettered by this app (read from the DLQ at start, then each one it
    rejects); one read again is neither counted nor dead-lettered again. `dlq` counts them all."""

    settings: MetricsSettings
    lettered: set[Where] = field(default_factory=set)
    windows: TumblingWindows = field(init=False)
    learner_version: int = 0
    learner_step: int = 0
    dlq: int = 0
    last_arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.windows = TumblingWindows(self.settings.window_s, self.settings.lateness_s)
        self.dlq = len(self.lettered)

    def _check(self, value: bytes | None) -> str | None:
        if value is None:
            return "empty value"
        if len(value) > self.settings.max_message_bytes:
            return f"oversized: {len(value)} bytes > max_message_bytes {self.settings.max_message_bytes}"
        return None

    def _points(self, closed: list[ClosedWindow]) -> list[MetricPoint]:
        pts = [p for w in closed for p in window_points(w, self.settings.window_s, self.learner_step)]
        if closed:
            end = (closed[-1].index + 1) * self.settings.window_s
            pts.append(MetricPoint(name="metrics/late", value=float(self.windows.late), time=end,
                                   trajectories=closed[-1].cumulative, learner_step=self.learner_step))
        return pts

    def _reject(self, reason: str, where: Where | None) -> tuple[list[MetricPoint], str | None]:
        """A cumulative `metrics/dlq` point and the reason; nothing for a record dead-lettered before."""
        if where is not None and where in self.lettered:
            return [], None
        if where is not None:
            self.lettered.add(where)
        self.dlq += 1
        point = MetricPoint(name="metrics/dlq", value=float(self.dlq), time=time.time(),
                            trajectories=self.windows.on_time, learner_step=self.learner_step)
        return [point], reason

    def _decode(self, value: bytes | None, cls: type) -> tuple[Any, str | None]:
        """(message, None) or (None, the reason it goes to the DLQ)."""
        reason = self._check(value)
        if reason is not None:
            return None, reason
        try:
            return decode(value, cls), None
        except SchemaError as e:
            return None, str(e)

    def on_trajectory(self, value: bytes | None, timestamp: float,
                      where: Where | None = None) -> tuple[list[MetricPoint], str | None]:
        """(points to publish, DLQ reason or None). `timestamp`: the record's, in seconds; `where`: its
        (topic, partition, offset), which keeps a record's dead letter from being sent twice.

        A rejected value yields a cumulative `metrics/dlq` point; closed windows yield their
        points followed by a cumulative `metrics/late` point.
        """
        self.last_arrival = time.monotonic()
        traj, reason = self._decode(value, Trajectory)
        if reason is None:
            reason = self._ahead(traj, time.time())
        if reason is not None:
            return self._reject(reason, where)
        self.windows.add(observe(traj, self.learner_version, timestamp))
        return self._points(self.windows.close_due()), None

    def _ahead(self, traj: Trajectory, now: float) -> str | None:
        """Event time drives the windows: one trajectory from the far future would make every later one late
        (non-finite times are refused when it is decoded)."""
        ahead = traj.finished_at - now
        if ahead > self.settings.max_clock_skew_s:
            return (f"Trajectory.finished_at: {traj.finished_at} is {ahead:.0f} s ahead of this clock "
                    f"(max_clock_skew_s {self.settings.max_clock_skew_s:g})")
        return None

    def on_learner(self, value: bytes | None, where: Where | None = None) -> tuple[list[MetricPoint], str | None]:
        ev, reason = self._decode(value, LearnerEvent)
        if reason is not None:
            return self._reject(reason, where)
        # Events may be redelivered or reordered across restarts: versions only move forward.
        self.learner_version = max(self.learner_version, ev.version)
        self.learner_step = max(self.learner_step, ev.step)
        point = MetricPoint(name="metrics/learner_version", value=float(self.learner_version), time=ev.time,
                            trajectories=self.windows.on_time, learner_step=self.learner_step)
        return [point], None

    def on_tick(self, now: float | None = None, force: bool = False) -> list[MetricPoint]:
        """After idle_flush_s without trajectories, close the windows the wall clock `now` has passed
        (all of them for a replayed, older stream; the current one stays open in a live stream).
        `force` closes every window (the app stops)."""
        if force:
            return self._points(self.windows.flush())
        if time.monotonic() - self.last_arrival < self.settings.idle_flush_s:
            return []
        return self._points(self.windows.close_before(time.time() if now is None else now))


def build_app(settings: MetricsSettings, bootstrap: str, lettered: set[Where] | None = None):
    """The faust app (imported here: faust is slow to import and `sao --help` must stay fast). `lettered`: the
    records this app dead-lettered before (`streamer.transport.kafka_bus.letters_in`)."""
    import faust

    from streamer.wire.settings import KafkaSecurity

    names = Topics(settings.run)
    app = faust.App(
        settings.app_id or f"{settings.run}.metrics-app",
        broker=f"kafka://{bootstrap}",
        value_serializer="raw",
        key_serializer="raw",
        processing_guarantee="at_least_once",
        store="memory://",
        web_enabled=settings.web_port > 0,
        web_port=settings.web_port or 6066,
        web_bind=settings.web_host,
        web_host=settings.web_host,
        broker_credentials=KafkaSecurity().faust_credentials(),
        consumer_auto_offset_reset="earliest",  # Tansu reports end offsets wrongly: never rely on "latest"
        broker_session_timeout=6.0,  # Tansu: group joins take ~session_timeout/2
        broker_heartbeat_interval=1.0,
        broker_commit_interval=settings.commit_interval_s,
    )

    def raw_topic(name: str):
        return app.topic(name, value_serializer="raw", key_serializer="raw")

    traj_topic, learner_topic = raw_topic(names.trajectories), raw_topic(names.learner)
    metrics_topic, dlq_topic = raw_topic(names.metrics), raw_topic(names.dlq)
    state = MetricsState(settings, set(lettered or ()))
    app.sao_state = state  # for introspection

    async def publish(points: list[MetricPoint]) -> None:
        for p in points:
            await metrics_topic.send(value=encode(p))

    async def consume(stream, handle, expected: str) -> None:
        async for event in stream.events():
            msg = event.message
            points, reason = handle(event.value, msg.timestamp, (msg.topic, msg.partition, msg.offset))
            if reason is not None:
                log.warning("%s[%d]@%d -> DLQ: %s", msg.topic, msg.partition, msg.offset, reason)
                await dlq_topic.send(key=msg.key, value=dead_letter(msg.topic, msg.partition, msg.offset, msg.key,
                                                                    event.value, reason, expected))
            await publish(points)

    @app.agent(traj_topic)
    async def trajectories(stream):
        await consume(stream, state.on_trajectory, "Trajectory")

    @app.agent(learner_topic)
    async def learner_events(stream):
        await consume(stream, lambda value, _ts, where: state.on_learner(value, where), "LearnerEvent")

    @app.timer(settings.tick_s)
    async def idle_flush():
        await publish(state.on_tick())

    @app.on_before_shutdown.connect
    async def flush_on_stop(app, **kwargs):
        await publish(state.on_tick(force=True))

    return app


def run(settings: MetricsSettings) -> int:
    """Run a faust worker in this process until SIGINT/SIGTERM."""
    settings.validate()
    import faust

    from streamer.transport.kafka_bus import KafkaBus, letters_in

    bus = KafkaBus(settings.bootstrap or None)
    # Create the run's topics with the project's partition counts before faust would guess them.
    bus.create_topics(partitions_by_topic(settings.run))
    lettered = letters_in(bus.bootstrap, bus.settings, Topics(settings.run).dlq, CONSUMER)
    app = build_app(settings, bus.bootstrap, lettered)
    worker = faust.Worker(app, loglevel=settings.loglevel, quiet=True, redirect_stdouts=False)
    worker.spinner = None  # terminal escape codes would land in the launcher's log files
    try:
        worker.execute_from_commandline()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def parse_args(argv: list[str]) -> MetricsSettings:
    ap = argparse.ArgumentParser(prog="sao metrics", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", default="",
                    help="Kafka bootstrap servers (default: $SAO_BOOTSTRAP or 127.0.0.1:9092)")
    ap.add_argument("--run", default=os.environ.get(RUN_ENV, "") or None,
                    help="run prefix of the topics (default: $SAO_RUN)")
    ap.add_argument("--window", type=float, default=None, help="tumbling window in seconds (default 5)")
    add_config_args(ap, "MetricsSettings", "lateness_s=2")
    args = ap.parse_args(argv)
    settings = load_config(MetricsSettings, args.config, args.overrides, section="metrics")
    flags = {k: v for k, v in (("bootstrap", args.bootstrap), ("run", args.run), ("window_s", args.window)) if v}
    settings = dataclasses.replace(settings, **flags)  # explicit flags win over the YAML file
    settings.validate()
    return settings


def main(argv: list[str]) -> int:
    try:
        settings = parse_args(argv)
    except ConfigError as e:
        print(f"sao metrics: {e}", file=sys.stderr)
        return 2
    return run(settings)

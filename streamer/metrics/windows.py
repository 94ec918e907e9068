"""Event-time tumbling windows over trajectories: pure aggregation, no I/O, no faust.

A trajectory becomes an `Observation` (event time = when the agent finished it). Window k
covers [k*W, (k+1)*W). For each closed window the app emits, at three levels of labels
({family, concept}, {family}, {} = every family), the metrics of `METRICS`:

- metrics/reward        mean reward
- metrics/success_rate  fraction of successful trajectories
- metrics/length        mean response tokens (len(tokens) - prompt_len)
- metrics/staleness     mean (learner version known when the trajectory arrived - policy_version), >= 0
- metrics/staleness_max largest staleness in the window
- metrics/throughput    trajectories per second (count / W)

`MetricPoint.count` is the number of trajectories in the window, `MetricPoint.time` its end,
`MetricPoint.trajectories` the on-time trajectories in this window and all earlier ones.

Why our own windows rather than faust's windowed tables: faust closes windows by wall clock
(`Table._del_old_keys` compares window ends with `time.time()`), so results depend on how fast
the app runs, and in faust 0.15.3 a second source partition that closes the same window after
the first is dropped (`last_closed_window`). Here a window closes when the event-time watermark
(largest event time seen) passes its end by `lateness_s`, so the same stream always gives the
same points; when the stream is idle the app also closes the windows the wall clock has passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from streamer.wire.schema import MetricPoint, Trajectory

METRICS = ("reward", "success_rate", "length", "staleness", "staleness_max", "throughput")


@dataclass(frozen=True)
class Observation:
    family: str
    concept: str
    time: float  # event time, seconds since the epoch
    reward: float
    success: bool
    length: int  # response tokens
    staleness: int


def observe(traj: Trajectory, learner_version: int, fallback_time: float) -> Observation:
    """`fallback_time` (the Kafka record timestamp) stands in when the agent left finished_at at 0."""
    return Observation(
        family=traj.family,
        concept=traj.concept,
        time=traj.finished_at if traj.finished_at > 0 else fallback_time,
        reward=float(traj.reward),
        success=bool(traj.success),
        length=len(traj.tokens) - traj.prompt_len,
        staleness=max(0, learner_version - traj.policy_version),
    )


@dataclass
class Aggregate:
    count: int = 0
    reward_sum: float = 0.0
    success_sum: int = 0
    length_sum: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0


def fold(agg: Aggregate, obs: Observation) -> Aggregate:
    """A new aggregate with one more observation (the argument is left unchanged)."""
    return Aggregate(
        count=agg.count + 1,
        reward_sum=agg.reward_sum + obs.reward,
        success_sum=agg.success_sum + int(obs.success),
        length_sum=agg.length_sum + obs.length,
        staleness_sum=agg.staleness_sum + obs.staleness,
        staleness_max=max(agg.staleness_max, obs.staleness),
    )


def merge(a: Aggregate, b: Aggregate) -> Aggregate:
    return Aggregate(
        count=a.count + b.count,
        reward_sum=a.reward_sum + b.reward_sum,
        success_sum=a.success_sum + b.success_sum,
        length_sum=a.length_sum + b.length_sum,
        staleness_sum=a.staleness_sum + b.staleness_sum,
        staleness_max=max(a.staleness_max, b.staleness_max),
    )


def values(agg: Aggregate, window_s: float) -> dict[str, float]:
    """The metrics of one non-empty aggregate, keyed by the short names of `METRICS`."""
    n = agg.count
    return {
        "reward": agg.reward_sum / n,
        "success_rate": agg.success_sum / n,
        "length": agg.length_sum / n,
        "staleness": agg.staleness_sum / n,
        "staleness_max": float(agg.staleness_max),
        "throughput": n / window_s,
    }


def window_index(t: float, window_s: float) -> int:
    return math.floor(t / window_s)


Key = tuple[str, str]  # (family, concept)


@dataclass
class ClosedWindow:
    index: int  # the window covers [index*W, (index+1)*W)
    groups: dict[Key, Aggregate]
    cumulative: int = 0  # on-time observations in this window and all earlier ones


def levels(groups: dict[Key, Aggregate]) -> list[tuple[dict[str, str], Aggregate]]:
    """(labels, aggregate) for every (family, concept), every family, and all together."""
    out: list[tuple[dict[str, str], Aggregate]] = []
    by_family: dict[str, Aggregate] = {}
    total = Aggregate()
    for (family, concept), agg in sorted(groups.items()):
        out.append(({"family": family, "concept": concept}, agg))
        by_family[family] = merge(by_family.get(family, Aggregate()), agg)
        total = merge(total, agg)
    out += [({"family": f}, a) for f, a in sorted(by_family.items())]
    out.append(({}, total))
    return out


def window_points(win: ClosedWindow, window_s: float, learner_step: int) -> list[MetricPoint]:
    """The MetricPoints of one closed window."""
    end = (win.index + 1) * window_s
    points = []
    for labels, agg in levels(win.groups):
        for name, value in values(agg, window_s).items():
            points.append(MetricPoint(name=f"metrics/{name}", value=value, time=end, labels=labels,
                                      window=window_s, count=agg.count, trajectories=win.cumulative,
                                      learner_step=learner_step))
    return points


@dataclass
class TumblingWindows:
    """Open windows, the watermark and what has closed. Add observations, then take closed windows."""

    window_s: float
    lateness_s: float = 1.0
    open: dict[int, dict[Key, Aggregate]] = field(default_factory=dict)
    watermark: float = -math.inf  # largest event time seen
    closed_below: int | None = None  # windows with a smaller index are closed
    late: int = 0  # observations that arrived after their window closed (not counted anywhere else)
    on_time: int = 0  # observations in closed windows

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"TumblingWindows.window_s: must be > 0, got {self.window_s}")
        if self.lateness_s < 0:
            raise ValueError(f"TumblingWindows.lateness_s: must be >= 0, got {self.lateness_s}")

    def add(self, obs: Observation) -> bool:
        """False when the observation's window has already closed (it is counted in `late`)."""
        k = window_index(obs.time, self.window_s)
        if self.closed_below is not None and k < self.closed_below:
            self.late += 1
            return False
        groups = self.open.setdefault(k, {})
        key = (obs.family, obs.concept)
        groups[key] = fold(groups.get(key, Aggregate()), obs)
        self.watermark = max(self.watermark, obs.time)
        return True

    def _close(self, keep) -> list[ClosedWindow]:
        done = sorted(k for k in self.open if not keep(k))
        out = []
        for k in done:
            groups = self.open.pop(k)
            self.on_time += sum(a.count for a in groups.values())
            out.append(ClosedWindow(k, groups, self.on_time))
        if done:
            self.closed_below = max(self.closed_below or done[-1] + 1, done[-1] + 1)
        return out

    def close_before(self, t: float) -> list[ClosedWindow]:
        """Windows whose end `t` has passed by lateness_s, oldest first."""
        return self._close(lambda k: (k + 1) * self.window_s + self.lateness_s > t)

    def close_due(self) -> list[ClosedWindow]:
        """Windows whose end the watermark has passed by lateness_s, oldest first."""
        return self.close_before(self.watermark)

    def flush(self) -> list[ClosedWindow]:
        """Close every open window (the stream is idle, or the app stops)."""
        return self._close(lambda k: False)

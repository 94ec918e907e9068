"""Answers you can read: a bounded sample of each run's answers, as text, in `runs/<run>/samples.jsonl`.

Per (family, concept, phase) the tap keeps the first `keep` answers and the latest `keep` (`AnswerSampler`), so the
file's size is bounded by the number of (family, concept, phase) keys, whatever the run's length. Each line is one
`AnswerSample`: the prompt and the answer as text (decoded from the trajectory's tokens with the run's tokenizer,
cut to `max_chars`), reward, policy version, task and trajectory ids, and whether it is among the first or the
latest of its key. The whole file is rewritten under a temporary name and renamed (`flush`), so a reader never
sees half of it; a restarted tap loads it back and skips the trajectories it holds (by `traj_id`) when it reads the
topics again from the start, so a restart neither loses nor repeats an answer.

Decoding happens at `flush`, for the kept answers only: a trajectory pushed out of the latest `keep` before the next
flush is never decoded. Without a tokenizer (a tap not handed one) the texts stay empty and `decoded` is false.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec

from streamer.runs.layout import ArtifactError
from streamer.wire.schema import Trajectory

SAMPLES_FILE = "samples.jsonl"
Decode = Callable[[list[int]], str]  # token ids -> text (a tokenizer's decode, special tokens skipped)
CUT = "…"


@dataclass(frozen=True)
class SampleSettings:
    keep: int = 6  # first and latest answers kept per (family, concept, phase)
    max_chars: int = 1000  # prompt and answer text cut to this many characters (the prompt keeps its end)
    flush_seconds: float = 5.0  # how often a live tap rewrites the file (when it changed)

    def __post_init__(self) -> None:
        if self.keep < 1 or self.max_chars < 1:
            raise ValueError(f"SampleSettings: keep ({self.keep}) and max_chars ({self.max_chars}) must be >= 1")


class AnswerSample(msgspec.Struct, kw_only=True):
    """One line of samples.jsonl."""

    traj_id: str
    task_id: str
    family: str
    concept: str
    phase: int
    policy_version: int
    reward: float
    success: bool
    time: float  # when the answer was finished (Trajectory.finished_at)
    first: bool = False  # among the first `keep` answers of its (family, concept, phase)
    latest: bool = False  # among the latest `keep`
    decoded: bool = False  # prompt and answer hold the decoded text
    prompt: str = ""
    answer: str = ""
    seq: int = 0  # arrival order in the tap (the latest are the highest)


@dataclass
class _Kept:
    sample: AnswerSample
    ids: tuple[list[int], list[int]] | None = None  # (prompt ids, answer ids) until decoded


def samples_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SAMPLES_FILE


def cut(text: str, max_chars: int, keep_end: bool = False) -> str:
    """`text` within `max_chars` characters, the cut marked with '…' (at the start when `keep_end`)."""
    if len(text) <= max_chars:
        return text
    return CUT + text[-(max_chars - 1):] if keep_end else text[:max_chars - 1] + CUT


class AnswerSampler:
    """First and latest `keep` answers per (family, concept, phase); `flush` writes them to samples.jsonl."""

    def __init__(self, run_dir: str | Path, settings: SampleSettings = SampleSettings(),
                 decode: Decode | None = None, clock: Callable[[], float] | None = None) -> None:
        self.path, self.s, self.decode = samples_path(run_dir), settings, decode
        self.clock = clock or time.monotonic
        self.first: dict[tuple, list[_Kept]] = {}
        self.latest: dict[tuple, deque[_Kept]] = {}
        self.held: dict[str, _Kept] = {}  # traj_id -> its entry (in first, latest or both)
        self.seq = 0
        self.dirty, self.last_flush = False, self.clock()
        for sample in read_samples(self.path.parent):  # a restarted tap: what the file holds stays
            self._restore(sample)

    def _restore(self, sample: AnswerSample) -> None:
        entry = _Kept(sample)
        key = (sample.family, sample.concept, sample.phase)
        if sample.first and len(self.first.setdefault(key, [])) < self.s.keep:
            self.first[key].append(entry)
        if sample.latest:
            self.latest.setdefault(key, deque(maxlen=self.s.keep)).append(entry)
        self.held[sample.traj_id] = entry
        self.seq = max(self.seq, sample.seq)

    def add(self, t: Trajectory) -> None:
        if t.traj_id in self.held:  # read again after a restart, or delivered twice
            return
        key = (t.family, t.concept, t.phase)
        self.seq += 1
        entry = _Kept(AnswerSample(traj_id=t.traj_id, task_id=t.task_id, family=t.family, concept=t.concept,
                                   phase=t.phase, policy_version=t.policy_version, reward=float(t.reward),
                                   success=t.success, time=t.finished_at, seq=self.seq),
                      (t.tokens[:t.prompt_len], t.tokens[t.prompt_len:]))
        first = self.first.setdefault(key, [])
        if len(first) < self.s.keep:
            first.append(entry)
        latest = self.latest.setdefault(key, deque(maxlen=self.s.keep))
        if len(latest) == latest.maxlen:
            self._release(latest[0])
        latest.append(entry)
        self.held[t.traj_id] = entry
        self.dirty = True

    def _release(self, entry: _Kept) -> None:
        """Forget an entry pushed out of the latest, unless it is also among the first."""
        s = entry.sample
        if not any(e is entry for e in self.first.get((s.family, s.concept, s.phase), ())):
            self.held.pop(s.traj_id, None)

    def samples(self) -> list[AnswerSample]:
        """What the file holds: every kept answer once, decoded, in arrival order."""
        in_first = {id(e) for f in self.first.values() for e in f}
        in_latest = {id(e) for d in self.latest.values() for e in d}
        out = []
        for entry in sorted(self.held.values(), key=lambda e: e.sample.seq):
            self._decode(entry)
            out.append(msgspec.structs.replace(entry.sample, first=id(entry) in in_first,
                                               latest=id(entry) in in_latest))
        return out

    def _decode(self, entry: _Kept) -> None:
        if entry.ids is None or self.decode is None:
            return
        prompt, answer = entry.ids
        entry.sample = msgspec.structs.replace(
            entry.sample, decoded=True, prompt=cut(self.decode(prompt), self.s.max_chars, keep_end=True),
            answer=cut(self.decode(answer), self.s.max_chars))
        entry.ids = None

    def maybe_flush(self) -> None:
        if self.dirty and self.clock() - self.last_flush >= self.s.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Rewrite samples.jsonl (temporary name, then rename) when it changed."""
        self.last_flush = self.clock()
        if not self.dirty:
            return
        lines = b"".join(msgspec.json.encode(s) + b"\n" for s in self.samples())
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(lines)
        os.replace(tmp, self.path)
        self.dirty = False


_decoder = msgspec.json.Decoder(AnswerSample)


def read_samples(run_dir: str | Path) -> list[AnswerSample]:
    """The samples of a run directory, in arrival order ([] when it has none); a bad line raises naming it."""
    path = samples_path(run_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for i, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            out.append(_decoder.decode(line))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ArtifactError(f"{path}:{i}: not an answer sample ({e})") from None
    return out


def latest_per_key(samples: list[AnswerSample], n: int, by: Callable[[AnswerSample], tuple]) -> list[AnswerSample]:
    """The `n` latest samples (by arrival) of each key `by(sample)`, grouped by key, oldest first in each group."""
    groups: dict[tuple, list[AnswerSample]] = {}
    for s in sorted(samples, key=lambda s: s.seq):
        groups.setdefault(by(s), []).append(s)
    return [s for key in sorted(groups) for s in groups[key][-n:]]

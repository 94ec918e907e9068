"""Chaos accounting: what a run under faults lost, trained twice and dead-lettered, and how fast it noticed and
recovered, from the broker's topics (which outlive the run) and the run directory's tables.

- every task the simulator published (read back from `<run>.tasks`, plus any the agents answered) is trained
  exactly once (the learner's standing events), buffered in the learner's last checkpoint (`pending.jsonl`: a run
  that stops mid-batch), dead-lettered, or still in a topic where a resumed run would find it (its trajectory at or
  past the learner's checkpoint position, or the task at or past the agents' committed offset: a run stopped by
  --max-seconds, or stalled); anything else is lost;
- every bad record is dead-lettered, by at least one consumer and by no consumer twice ((consumer, record) pairs);
- each fault's time to detect (the `sao up` line that reports the role's exit) and to recover (the role's next
  output in the run's tables: a learner event, a trajectory of the restarted agent, a metric point).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

from bench.chaos_faults import BAD_PREFIX
from streamer.runs import artifacts as art
from streamer.runs.readers import read_table
from streamer.transport.backpressure import CommittedOffsets
from streamer.transport.bus import TopicPartition
from streamer.transport.kafka_bus import read_topic
from streamer.wire.schema import DeadLetter, SchemaError, Task, Trajectory, decode, decode_json
from streamer.wire.settings import ClientSettings
from streamer.wire.topics import Topics


def whole_topic(bootstrap: str, topic: str) -> list[tuple[int, int, bytes]]:
    """Every record of `topic`: to its end offsets, then until 3 s (12 polls) brought nothing."""
    return read_topic(bootstrap, ClientSettings(), topic, timeout_s=120.0, idle_polls=12)


def trained_counts(run_dir: Path) -> tuple[Counter, pd.DataFrame]:
    learner = art.read_learner(run_dir)
    ids = learner["task_ids"] if len(learner) and "task_ids" in learner else []
    return Counter(t for x in ids for t in (json.loads(x) if isinstance(x, str) else x)), learner


def pending_in_last_checkpoint(run_dir: Path) -> set[str]:
    ckpt = max((run_dir / "checkpoints").glob("step_*"), default=None)
    if ckpt is None or not (ckpt / "pending.jsonl").is_file():
        return set()
    return {decode_json(line, Trajectory).task_id for line in (ckpt / "pending.jsonl").read_bytes().splitlines()
            if line}


def last_checkpoint_positions(run_dir: Path) -> dict[str, int]:
    """The learner's source positions ('<topic>:<partition>' -> next offset) in its newest checkpoint."""
    ckpt = max((run_dir / "checkpoints").glob("step_*"), default=None)
    if ckpt is None or not (ckpt / "state.json").is_file():
        return {}
    return {k: int(v) for k, v in json.loads((ckpt / "state.json").read_text()).get("positions", {}).items()}


def still_in_topics(tasks: dict[str, tuple[int, int]], trajs: dict[str, list[tuple[int, int]]],
                    committed: dict[int, int], positions: dict[str, int], topic: str) -> tuple[set[str], set[str]]:
    """Tasks a resumed run would still get to: those with a trajectory at or past the learner's checkpoint position
    (unread by it), and those with none at or past the agents' committed offset (unanswered)."""
    unread = {t for t, recs in trajs.items() if any(o >= positions.get(f"{topic}:{p}", 0) for p, o in recs)}
    unanswered = {t for t, (p, o) in tasks.items() if t not in trajs and o >= committed.get(p, 0)}
    return unread, unanswered


def account_tasks(run_dir: Path, tasks: dict[str, tuple[int, int]], trajs: dict[str, list[tuple[int, int]]],
                  committed: dict[int, int], traj_topic: str, dead_tasks: set[str]) -> dict[str, Any]:
    """Every task trained once, buffered in the last checkpoint, dead-lettered, or still in a topic for a resumed
    run (its trajectory unread by the learner, or the task unanswered); anything else is lost."""
    ids = {t for t in set(tasks) | set(trajs) if not t.startswith(BAD_PREFIX)}
    trained, learner = trained_counts(run_dir)
    pending = pending_in_last_checkpoint(run_dir)
    unread, unanswered = still_in_topics(tasks, trajs, committed, last_checkpoint_positions(run_dir), traj_topic)
    settled = {t for t in ids if trained[t]} | pending | dead_tasks
    last = learner.iloc[-1].dropna().to_dict() if len(learner) else {}
    return {
        "tasks": len(ids), "trained_once": sum(1 for t in ids if trained[t] == 1),
        "trained_twice": sorted(t for t in ids if trained[t] > 1),
        "buffered_in_last_checkpoint": len(pending & ids), "dead_lettered_tasks": len(dead_tasks & ids),
        "unread_by_learner": len((ids & unread) - settled), "unanswered_in_topic": len((ids & unanswered) - settled),
        "lost": sorted(ids - settled - unread - unanswered),
        "bad_records_trained": sorted(t for t in trained if t.startswith(BAD_PREFIX)),
        "stale_drops": float(last.get("learner/count_stale", 0.0)),
        "duplicate_drops": float(last.get("learner/count_duplicate", 0.0)), "learner_steps": int(len(learner)),
        "longest_learner_gap_s": longest_gap(read_table(run_dir, "learner")),
    }


def learner_idle_before(run_dir: Path, wall: float) -> float | None:
    """Seconds from the learner's last event to `wall` (the run's stop): a stall that lasted to the end shows here."""
    table = read_table(run_dir, "learner")
    return round(wall - float(table["time"].max()), 1) if len(table) and "time" in table else None


def longest_gap(learner: pd.DataFrame) -> float | None:
    """The longest time between two learner events: a stall shows here."""
    if len(learner) < 2 or "time" not in learner:
        return None
    return round(float(learner["time"].sort_values().diff().max()), 1)


def account_bad_records(bad: list[dict[str, Any]], letters: list[DeadLetter]) -> list[dict[str, Any]]:
    """Each bad record with the consumers that dead-lettered it (name -> letters sent)."""
    by_record: dict[tuple[str, int, int], Counter] = defaultdict(Counter)
    reasons: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    for x in letters:
        by_record[(x.topic, x.partition, x.offset)][x.consumer] += 1
        reasons[(x.topic, x.partition, x.offset)].add(x.reason[:160])
    out = []
    for r in bad:
        key = (r["topic"], r["partition"], r["offset"])
        consumers = dict(by_record.get(key, {}))
        out.append({**r, "letters_by_consumer": consumers, "dead_lettered": bool(consumers),
                    "sent_twice_by": sorted(c for c, n in consumers.items() if n > 1),
                    "reasons": sorted(reasons.get(key, ()))})
    return out


def decoded(records: list[tuple[int, int, bytes]], cls: type) -> list[tuple[int, int, Any]]:
    out = []
    for part, off, value in records:
        try:
            out.append((part, off, decode(value, cls)))
        except SchemaError:
            pass
    return out


def account(bootstrap: str, run: str, run_dir: Path, bad: list[dict[str, Any]]) -> dict[str, Any]:
    """Tasks and bad records of one run, read from its (still running) broker and its directory."""
    topics = Topics(run)
    task_records = whole_topic(bootstrap, topics.tasks)
    tasks = {m.task_id: (p, o) for p, o, m in decoded(task_records, Task)}
    trajs: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for p, o, m in decoded(whole_topic(bootstrap, topics.trajectories), Trajectory):
        trajs[m.task_id].append((p, o))
    letters = [m for _, _, m in decoded(whole_topic(bootstrap, topics.dlq), DeadLetter)]
    group = CommittedOffsets(bootstrap, f"{run}.agents", client_id="chaos-accounting")
    try:
        committed = {tp.partition: n for tp, n in group({TopicPartition(topics.tasks, p) for p, _ in
                                                         tasks.values()}).items()}
    finally:
        group.close()
    dead_tasks = {x.key.decode(errors="replace") for x in letters if x.key and x.expected == "Task"}
    pairs = Counter((x.consumer, x.topic, x.partition, x.offset) for x in letters)
    return {"task_records": len(task_records), "tasks_in_topic": len(tasks), "dead_letters": len(letters),
            "letters_sent_twice": sum(1 for n in pairs.values() if n > 1),
            "dlq_reasons": sorted({x.reason[:120] for x in letters}), "bad_records": account_bad_records(bad, letters),
            **account_tasks(run_dir, tasks, dict(trajs), committed, topics.trajectories, dead_tasks)}


def first_after(times: pd.Series, t: float) -> float | None:
    later = times[times > t]
    return round(float(later.min()) - t, 2) if len(later) else None


def recovery_s(run_dir: Path, fault: dict[str, Any]) -> float | None:
    """Seconds from the fault (its SIGCONT for a pause) to the role's next output in the run's tables."""
    done, role = fault["done"], fault["role"]
    if "wall" not in done:
        return None
    t = done.get("cont_wall", done["wall"])
    if role == "learner":
        table = read_table(run_dir, "learner")
        return first_after(table["time"], t) if "time" in table else None
    if role == "metrics":
        table = art.read_metrics(run_dir)
        return first_after(table["time"], t) if "time" in table else None
    if role.startswith("agent-"):  # sao up names each agent by its role; a restarted one keeps the name
        traj = art.read_trajectories(run_dir)
        if not len(traj) or "agent_id" not in traj:
            return None
        return first_after(traj.loc[traj["agent_id"] == role, "finished_at"], t)
    return None


def detection_s(up_lines: list[tuple[float, str]], fault: dict[str, Any]) -> float | None:
    """Seconds from the fault to `sao up`'s line reporting it: the role's exit (a kill), or the run's stop (the
    broker). A pause is not a crash: the supervisor has nothing to detect, the consumer group does."""
    done, role = fault["done"], fault["role"]
    if "wall" not in done or fault["kind"] != "sigkill":
        return None
    marker = "stopping:" if role == "broker" else f"{role} exited"
    t = next((w for w, line in up_lines if w >= done["wall"] and line.startswith(marker)), None)
    return None if t is None else round(t - done["wall"], 2)


def timings(run_dir: Path, up_lines: list[tuple[float, str]], faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**f, "detect_s": detection_s(up_lines, f), "recover_s": recovery_s(run_dir, f)} for f in faults]

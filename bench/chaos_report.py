"""Chaos figures: a broker run's losses, the per-fault-class table and the goals, from the runs' accounting."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from statistics import median
from typing import Any

from bench.chaos_accounting import pending_in_last_checkpoint, trained_counts
from streamer.runs import artifacts as art

PROGRESS = re.compile(r"\] tasks (\d+) answered (\d+) .* learner step (\d+|-)")


def last_progress(lines: list[tuple[float, str]], before: float) -> dict[str, int]:
    """The tap's counts in `sao up`'s last progress line before the wall time `before`."""
    for wall, line in reversed(lines):
        m = PROGRESS.search(line)
        if wall <= before and m:
            return {"tasks": int(m[1]), "answered": int(m[2]), "learner_step": -1 if m[3] == "-" else int(m[3])}
    return {"tasks": 0, "answered": 0, "learner_step": -1}


def checkpointed(run_dir: Path) -> dict[str, int]:
    """The learner's newest checkpoint: its step, and the tasks it holds as trained (admitted, not pending)."""
    ckpt = max((run_dir / "checkpoints").glob("step_*"), default=None)
    if ckpt is None or not (ckpt / "state.json").is_file():
        return {"step": -1, "trained": 0}
    state = json.loads((ckpt / "state.json").read_text())
    seen = set(state.get("admission", {}).get("seen", []))
    return {"step": int(state["step"]), "trained": len(seen - pending_in_last_checkpoint(run_dir))}


def broker_result(run_dir: Path, fault: dict[str, Any], lines: list[tuple[float, str]], stopped: str,
                  exit_wall: float) -> dict[str, Any]:
    """What a killed memory-only broker took with it: the tasks published (the tap's count when it died) that no
    learner checkpoint holds as trained or buffered (the topics, offsets and DLQ are gone, the checkpoints stay); and
    how long `sao up` took to notice (`detect_s`: only when its reason names the broker) and to exit."""
    done = fault["done"]
    if "wall" not in done:
        return {"fault": fault, "killed": False}
    at_kill, ckpt = last_progress(lines, done["wall"] + 0.5), checkpointed(run_dir)
    buffered = len(pending_in_last_checkpoint(run_dir))
    named = "broker" in stopped.lower()
    return {"fault": fault, "killed": True, "stopped_after_kill_s": fault["detect_s"],
            "detect_s": fault["detect_s"] if named else None, "exit_after_kill_s": round(exit_wall - done["wall"], 1),
            "reason_names_broker": named, "stopped": stopped, "at_kill": at_kill,
            "tasks_published": at_kill["tasks"], "trajectories_recorded": len(art.read_trajectories(run_dir)),
            "trained_recorded": sum(1 for n in trained_counts(run_dir)[0].values() if n),
            "checkpoint_step": ckpt["step"], "trained_in_last_checkpoint": ckpt["trained"],
            "buffered_in_last_checkpoint": buffered,
            "not_in_a_checkpoint_gone_with_broker": max(0, at_kill["tasks"] - ckpt["trained"] - buffered)}


def short_reason(stopped: str) -> str:
    """`sao up`'s stop reason without its addresses, paths and advice: one per kind of stop across seeds."""
    text = re.sub(r"\S+:\d+\b", "HOST:PORT", stopped)
    return re.split(r" \(its log|; ", text)[0]


def spread(values: list[float | None]) -> dict[str, Any]:
    xs = [x for x in values if x is not None]
    return {"n": len(xs), "median": round(median(xs), 2) if xs else None, "max": max(xs) if xs else None}


def summarize(runs: list[dict[str, Any]], broker_runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault class: injected (of requested), time to detect and to recover; lost and trained twice are the
    totals of the runs the class ran in (one run holds several classes: a loss cannot be pinned on one fault)."""
    by: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        for f in r["faults"]:
            if f["kind"] == "bad_records":
                continue
            c = by[f["fault_class"]]
            c["requested"].append(1)
            c["injected"].append(int("wall" in f["done"]))
            c["detect"].append(f["detect_s"])
            c["recover"].append(f["recover_s"])
    lost = sum(len(r["lost"]) for r in runs)  # in neither a step, the last checkpoint, the DLQ nor a topic
    twice = sum(len(r["trained_twice"]) for r in runs)
    out = {k: {"requested": sum(c["requested"]), "injected": sum(c["injected"]), "detect_s": spread(c["detect"]),
               "recover_s": spread(c["recover"]), "lost_in_its_runs": lost, "trained_twice_in_its_runs": twice}
           for k, c in sorted(by.items())}
    for topic, records in bad_by_topic(runs).items():
        out[f"bad_records_{topic}"] = {
            "injected": len(records), "dead_lettered": sum(x["dead_lettered"] for x in records),
            "sent_twice_by_one_consumer": sum(bool(x["sent_twice_by"]) for x in records),
            "consumers": sorted({c for x in records for c in x["letters_by_consumer"]}),
            "not_dead_lettered": sorted({x["what"] for x in records if not x["dead_lettered"]}),
            "lost_in_its_runs": lost, "trained_twice_in_its_runs": twice}
    if broker_runs:
        killed = [b for b in broker_runs if b.get("killed")]
        out["sigkill_broker"] = {
            "requested": len(broker_runs), "injected": len(killed), "detect_s": spread([b["detect_s"] for b in killed]),
            "reason_names_broker": sum(b["reason_names_broker"] for b in killed),
            "stop_reasons": sorted({short_reason(b["stopped"]) for b in killed}),
            "tasks_published": sum(b["tasks_published"] for b in killed),
            "trained_in_last_checkpoint": sum(b["trained_in_last_checkpoint"] for b in killed),
            "not_in_a_checkpoint_gone_with_broker": sum(b["not_in_a_checkpoint_gone_with_broker"] for b in killed)}
    return out


def bad_by_topic(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        for x in r["bad_records"]:
            out[x["topic"].rpartition(".")[2]].append(x)
    return dict(out)


def goals(runs: list[dict[str, Any]], broker_runs: list[dict[str, Any]]) -> dict[str, bool]:
    faults = [f for r in runs for f in r["faults"]] + [b["fault"] for b in broker_runs]
    bad = [x for r in runs for x in r["bad_records"]]
    return {
        "every_fault_injected": all("wall" in f["done"] for f in faults),
        "bad_records_sent": bool(bad) and all(f["done"].get("records") for f in faults if f["kind"] == "bad_records"),
        "lost": all(not r["lost"] for r in runs), "trained_twice": all(not r["trained_twice"] for r in runs),
        "stale_drops": all(r["stale_drops"] == 0 for r in runs),
        "every_run_finished": all(r["stopped"].startswith("scenario finished") for r in runs),
        "every_bad_record_dead_lettered": all(x["dead_lettered"] for x in bad),
        "no_consumer_letters_a_record_twice": all(not x["sent_twice_by"] for x in bad),
        "no_bad_record_trained": all(not r["bad_records_trained"] for r in runs),
        "every_killed_role_recovered": all(f["recover_s"] is not None for r in runs for f in r["faults"]
                                           if f["kind"] != "bad_records"),
        "broker_loss_named": all(b.get("reason_names_broker") for b in broker_runs),
    }

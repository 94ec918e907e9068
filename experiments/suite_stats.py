"""Statistics that match the suite's claims (issue 49, item 5): intervals that resample drifts as well as seeds, and
suite draws (versions, machine kinds) as well, Holm's correction across arms, and a verdict per arm.

The old reports resampled seeds only, over per-seed means across the 7 drifts: an interval for these 7 drifts, not
for drifts like them. `hierarchical_bootstrap` resamples both (crossed: one drift draw for the whole resample);
`pooled_bootstrap` adds a third level, the draws of the suite (seeds nested in draws, drifts shared). The CLI reads
the committed manifest of draws (experiments/suites/draws.yaml), taking each JSON from git history or the tree:

    .venv/bin/python -m experiments.suite_stats --out docs/results/suite_main/pooled_draws.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from experiments import stats

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "experiments" / "suites" / "draws.yaml"
OUT = ROOT / "docs" / "results" / "suite_main" / "pooled_draws.json"
HOLDS, DOES_NOT, NOT_SEPARABLE = "holds", "does not", "not separable at this power"


# ------------------------------------------------------------------ the bootstrap

def resample_counts(rng: np.random.Generator, n, cells: int, size: int) -> np.ndarray:
    """How often each of `cells` items is drawn in each of `size` resamples of `n` draws with replacement
    (`n` an int or one per resample)."""
    return rng.multinomial(n, np.full(cells, 1.0 / cells), size=size)


def _complete(diffs) -> np.ndarray:
    d = np.asarray(diffs, float)
    if d.ndim != 2 or d.size == 0 or not np.isfinite(d).all():
        raise ValueError(f"diffs must be a complete, non-empty [seed, drift] array, got shape {d.shape}")
    return d


def two_level_means(diffs, n_boot: int, seed: int = 0) -> np.ndarray:
    """The mean of each resample that draws seeds and drifts with replacement (crossed: the cells of the chosen seeds
    at the chosen drifts)."""
    d = _complete(diffs)
    rng = np.random.default_rng(seed)
    seeds = resample_counts(rng, d.shape[0], d.shape[0], n_boot)
    drifts = resample_counts(rng, d.shape[1], d.shape[1], n_boot)
    return ((seeds @ d) * drifts).sum(axis=1) / d.size


def three_level_means(draws: list, n_boot: int, seed: int = 0) -> np.ndarray:
    """The mean of each resample that draws the draws with replacement, then seeds within each chosen draw (a draw
    chosen m times: m independent seed resamples, i.e. m x its seeds drawn), then drifts (one draw shared by all).
    Each chosen draw weighs the same, whatever its seeds."""
    ds = [_complete(d) for d in draws]
    if len({d.shape[1] for d in ds}) != 1:
        raise ValueError("every draw must hold the same drifts (columns)")
    rng = np.random.default_rng(seed)
    k, n_drifts = len(ds), ds[0].shape[1]
    chosen = resample_counts(rng, k, k, n_boot)
    per_drift = np.zeros((n_boot, n_drifts))
    for j, d in enumerate(ds):
        m = chosen[:, j]
        seeds = resample_counts(rng, m * d.shape[0], d.shape[0], n_boot)
        per_drift += (m / k)[:, None] * (seeds @ d) / np.maximum(m * d.shape[0], 1)[:, None]
    drifts = resample_counts(rng, n_drifts, n_drifts, n_boot)
    return (per_drift * drifts).sum(axis=1) / n_drifts


def two_sided_p(means: np.ndarray) -> float:
    """2 x the smaller share of resampled means on either side of 0 (ties count on both), at most 1."""
    return float(min(1.0, 2 * min(np.mean(means <= 0), np.mean(means >= 0))))


def summary(point: float, means: np.ndarray, level: float) -> dict[str, float]:
    a = (1.0 - level) / 2
    return {"mean": float(point), "low": float(np.quantile(means, a)), "high": float(np.quantile(means, 1 - a)),
            "p": two_sided_p(means)}


def hierarchical_bootstrap(diffs, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Mean of a complete [seed, drift] array of paired differences, its percentile interval and two-sided p from
    `two_level_means`."""
    d = _complete(diffs)
    return {**summary(d.mean(), two_level_means(d, n_boot, seed), level),
            "n_seeds": int(d.shape[0]), "n_drifts": int(d.shape[1])}


def pooled_bootstrap(draws: list, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """The mean of the draws' means (arrays [seed, drift], drifts shared), its interval and p from
    `three_level_means`."""
    ds = [_complete(d) for d in draws]
    point = float(np.mean([d.mean() for d in ds]))
    return {**summary(point, three_level_means(ds, n_boot, seed), level), "n_draws": len(ds),
            "n_seeds": [int(d.shape[0]) for d in ds], "n_drifts": int(ds[0].shape[1])}


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm-Bonferroni adjusted p-values: the i-th smallest times (m - i + 1), running maximum, at most 1."""
    order = sorted(pvalues, key=pvalues.get)
    out, running = {}, 0.0
    for i, name in enumerate(order):
        running = max(running, min(1.0, (len(order) - i) * pvalues[name]))
        out[name] = running
    return out


def verdict(interval: dict, adjusted_p: float, alpha: float = 0.05) -> str:
    """The claim 'the arm is below the reference' `holds` (mean < 0, adjusted p < alpha), `does not` (separates the
    other way), or is not separable at this power (always so from one seed: nothing varies to resample)."""
    seeds = interval.get("n_seeds", 2)  # a list when pooled over draws
    if adjusted_p >= alpha or interval["mean"] == 0 or (sum(seeds) if isinstance(seeds, list) else seeds) < 2:
        return NOT_SEPARABLE
    return HOLDS if interval["mean"] < 0 else DOES_NOT


# ------------------------------------------------------------------ draws

def diff_matrix(runs: list[dict], arm: str, ref: str, outcome: str, drifts: list[str]) -> np.ndarray:
    """[seed, drift] array of `arm` minus `ref` in `outcome`; every (seed, drift) must have both runs."""
    cell = {(r["seed"], r["drift"], r["arm"]): r[outcome] for r in runs}
    seeds = sorted({r["seed"] for r in runs if r["arm"] == arm})
    missing = [(s, dr) for s in seeds for dr in drifts if (s, dr, arm) not in cell or (s, dr, ref) not in cell]
    if missing:
        raise ValueError(f"{arm} - {ref}: no pair at (seed, drift) {missing[:3]} ({len(missing)} missing)")
    return np.array([[cell[(s, dr, arm)] - cell[(s, dr, ref)] for dr in drifts] for s in seeds])


def read_json(entry: dict, root: Path) -> dict:
    """A draw's JSON: `git show COMMIT:PATH` where the entry names a commit, else the file under `root`."""
    name, path, commit = entry["name"], entry["path"], entry.get("commit")
    if commit:
        shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True)
        if shown.returncode:
            raise ValueError(f"draw {name}: git show {commit}:{path} failed: {shown.stderr.strip()}")
        return json.loads(shown.stdout)
    file = root / path
    if not file.is_file():
        raise ValueError(f"draw {name}: no file {file}")
    return json.loads(file.read_text())


def check_draw(entry: dict, result: dict) -> None:
    """Refuse a JSON without per-run records or of another suite version than the manifest says."""
    if not isinstance(result.get("runs"), list):
        raise ValueError(f"draw {entry['name']}: {entry['path']} has no per-run records ('runs' list)")
    if str(result.get("suite_version")) != str(entry["suite_version"]):
        raise ValueError(f"draw {entry['name']}: suite_version {result.get('suite_version')!r} in the file, "
                         f"{entry['suite_version']!r} in the manifest")


def run_keys(result: dict) -> set[tuple]:
    """What identifies a run across files: suite version, warm start, drift, seed, arm."""
    head = (str(result.get("suite_version")), result.get("init_sha256"))
    return {head + (r["drift"], r["seed"], r["arm"]) for r in result["runs"]}


def refuse_double_counts(draws: list[dict]) -> None:
    """Refuse two draws that share a run (one a part, pool or rerun of the other): it would count twice."""
    for i, a in enumerate(draws):
        for b in draws[i + 1:]:
            if shared := run_keys(a["result"]) & run_keys(b["result"]):
                raise ValueError(f"draws {a['name']} and {b['name']} share {len(shared)} runs (one holds the "
                                 f"other's, e.g. {sorted(shared)[0][2:]}): list only one of them")


def load_draws(manifest: Path, root: Path = ROOT) -> tuple[dict, list[dict]]:
    """The manifest and its draws, each with its JSON under 'result', checked (`check_draw`,
    `refuse_double_counts`)."""
    spec = yaml.safe_load(Path(manifest).read_text())
    draws = []
    for entry in spec["draws"]:
        result = read_json(entry, root)
        check_draw(entry, result)
        draws.append({**entry, "result": result})
    refuse_double_counts(draws)
    return spec, draws


# ------------------------------------------------------------------ the analysis

def own_drifts(draw: dict) -> list[str]:
    return sorted({r["drift"] for r in draw["result"]["runs"]})


def shared_drifts(draws: list[dict]) -> list[str]:
    """The drifts every draw ran: the pool's columns (a later version may add drifts; they count in its own draw)."""
    shared = sorted(set.intersection(*(set(own_drifts(d)) for d in draws)))
    if not shared:
        raise ValueError(f"the draws share no drift: {[own_drifts(d) for d in draws]}")
    return shared


def arms_of(draws: list[dict], ref: str) -> list[str]:
    """Every arm but `ref` in any draw, in order of first appearance."""
    seen = [r["arm"] for d in draws for r in d["result"]["runs"]]
    return [a for a in dict.fromkeys(seen) if a != ref]


def per_draw(draw: dict, arms: list[str], ref: str, outcome: str, n_boot: int) -> dict:
    """One draw over its own drifts: per arm the hierarchical interval and p, Holm across the draw's arms, verdict;
    beside it the seeds-only bootstrap of the old reports (per-seed means over drifts, `stats.paired_bootstrap`)."""
    runs, drifts = draw["result"]["runs"], own_drifts(draw)
    present = [a for a in arms if any(r["arm"] == a for r in runs)]
    rows = {}
    for arm in present:
        d = diff_matrix(runs, arm, ref, outcome, drifts)
        old = stats.paired_bootstrap(d.mean(axis=1), n_boot=n_boot)
        rows[arm] = {"hierarchical": hierarchical_bootstrap(d, n_boot),
                     "seeds_only": {**old, "separates": stats.verdict(old) != "0"}}
    adjusted = holm({a: r["hierarchical"]["p"] for a, r in rows.items()})
    for arm, r in rows.items():
        r["holm_p"] = adjusted[arm]
        r["verdict"] = verdict(r["hierarchical"], adjusted[arm])
    return {"name": draw["name"], "suite_version": str(draw["suite_version"]), "machine_kind": draw["machine_kind"],
            "init_sha256": draw["result"].get("init_sha256"), "drifts": drifts, "arms": rows}


def pooled(draws: list[dict], arms: list[str], ref: str, outcome: str, drifts: list[str], n_boot: int) -> dict:
    """Per arm, `pooled_bootstrap` over the draws that ran it; Holm across arms; verdict."""
    rows = {}
    for arm in arms:
        having = [d for d in draws if any(r["arm"] == arm for r in d["result"]["runs"])]
        mats = [diff_matrix(d["result"]["runs"], arm, ref, outcome, drifts) for d in having]
        rows[arm] = {"draws": [d["name"] for d in having], **pooled_bootstrap(mats, n_boot)}
    adjusted = holm({a: r["p"] for a, r in rows.items()})
    for arm, r in rows.items():
        r["holm_p"] = adjusted[arm]
        r["verdict"] = verdict(r, adjusted[arm])
    return rows


def analyse(spec: dict, draws: list[dict], n_boot: int = 10_000) -> dict[str, Any]:
    ref, outcome = spec.get("reference_arm", "sao"), spec.get("outcome", "auc_equal_rollouts")
    drifts = shared_drifts(draws)
    arms = arms_of(draws, ref)
    preregistered = [d for d in draws if d.get("preregistered", True)]
    return {"what": f"{outcome}: arm minus {ref}, each draw over its own drifts, pooled over the drifts every draw "
                    f"ran; intervals 95% percentile bootstrap "
                    f"({n_boot:,} resamples), p two-sided bootstrap, Holm across arms; verdict on the claim "
                    f"'arm below {ref}' at alpha 0.05",
            "outcome": outcome, "reference_arm": ref, "drifts": drifts, "n_boot": n_boot,
            "draws": [{k: d.get(k) for k in ("name", "suite_version", "machine_kind", "commit", "path",
                                             "preregistered")} for d in draws],
            "per_draw": [per_draw(d, arms, ref, outcome, n_boot) for d in draws],
            "pooled": pooled(draws, arms, ref, outcome, drifts, n_boot),
            "pooled_preregistered_only": pooled(preregistered, arms_of(preregistered, ref), ref, outcome, drifts,
                                                n_boot)}


# ------------------------------------------------------------------ the report

def ci(r: dict) -> str:
    return f"{r['mean']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]"


def p_cell(p: float, n_boot: int) -> str:
    """A bootstrap p; 0 (no resample on the other side) shown as under the resolution 1 / n_boot."""
    return f"< {1 / n_boot:.4f}" if p == 0 else f"{p:.4f}"


def pooled_table(result: dict, key: str) -> list[str]:
    used = {name for r in result[key].values() for name in r["draws"]}
    names = [d["name"] for d in result["draws"] if d["name"] in used]
    n = result["n_boot"]
    means = {d["name"]: {a: r["hierarchical"]["mean"] for a, r in d["arms"].items()} for d in result["per_draw"]}
    lines = ["| arm | " + " | ".join(names) + " | pooled mean [95%] | p | Holm p | verdict |",
             "|---|" + "---|" * (len(names) + 4)]
    for arm, r in result[key].items():
        cells = [f"{means[name][arm]:+.3f}" if arm in means[name] else "-" for name in names]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {ci(r)} | {p_cell(r['p'], n)} | "
                     f"{p_cell(r['holm_p'], n)} | {r['verdict']} |")
    return lines


def draw_table(d: dict, n: int) -> list[str]:
    lines = [f"### {d['name']} (suite {d['suite_version']}, {d['machine_kind']}, {len(d['drifts'])} drifts)", "",
             "| arm | seeds and drifts resampled [95%] | p | Holm p | verdict | seeds only (old reports) [95%] |",
             "|---|---|---|---|---|---|"]
    for arm, r in d["arms"].items():
        old = r["seeds_only"]
        lines.append(f"| {arm} | {ci(r['hierarchical'])} | {p_cell(r['hierarchical']['p'], n)} | "
                     f"{p_cell(r['holm_p'], n)} | {r['verdict']} | {ci(old)}{'*' if old['separates'] else ''} |")
    return lines + [""]


NOTES = ("Per-draw columns: that draw's mean difference. Pooled: the mean of the draws' means; each resample draws "
         "the draws, the seeds within each and the drifts (shared) with replacement, so with 4-5 draws the top level "
         "is coarse. Holm's family: every arm of the table, the controls (frozen, eta0) included. 'does not': "
         "separates above the reference. A p of 0 is shown as under 1 / resamples.")


def markdown(result: dict) -> str:
    head = [f"# The suite's draws pooled: {result['outcome']}, arm minus {result['reference_arm']}", "",
            "Generated by `python -m experiments.suite_stats` from `experiments/suites/draws.yaml`; "
            + result["what"] + ". " + NOTES, "", "## All draws", ""]
    pre = ["", "## Pre-registered draws only", ""]
    return "\n".join(head + pooled_table(result, "pooled") + pre + pooled_table(result, "pooled_preregistered_only")
                     + ["", "## Per draw (`*`: the old seeds-only interval excludes 0)", ""]
                     + [line for d in result["per_draw"] for line in draw_table(d, result["n_boot"])])


def rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 5)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return [rounded(v) for v in x] if isinstance(x, list) else x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--root", type=Path, default=ROOT, help="the repository the manifest's paths are in")
    p.add_argument("--n-boot", type=int, default=10_000)
    p.add_argument("--out", type=Path, default=OUT, help="the JSON; the .md goes beside it")
    a = p.parse_args(argv)
    spec, draws = load_draws(a.manifest, a.root)
    result = rounded(analyse(spec, draws, a.n_boot))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print("\n".join(pooled_table(result, "pooled")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

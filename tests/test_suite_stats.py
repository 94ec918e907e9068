"""experiments/suite_stats.py: the hierarchical and pooled bootstraps against hand enumeration, Holm, verdicts, and
the manifest of draws (temp files only, no git history)."""

import json

import numpy as np
import pytest
import yaml

from experiments import stats
from experiments.suite_stats import (
    DOES_NOT,
    HOLDS,
    NOT_SEPARABLE,
    hierarchical_bootstrap,
    holm,
    load_draws,
    main,
    pooled_bootstrap,
    three_level_means,
    two_level_means,
    verdict,
)

# 2 seeds x 2 drifts. Each level draws the ordered pairs (0,0), (0,1), (1,0), (1,1) with probability 1/4 each, so
# 16 equally likely resamples; their means, by hand:
#   seeds {0,0}: row [1, 2]     -> 1, 1.5, 1.5, 2
#   seeds {0,1} twice: [2.5, 5] -> 2.5, 3.75, 3.75, 5 (each twice)
#   seeds {1,1}: row [4, 8]     -> 4, 6, 6, 8
# CDF: 1 -> 1/16, 1.5 -> 3/16, 2 -> 4/16, 2.5 -> 6/16, 3.75 -> 10/16, 4 -> 11/16, 5 -> 13/16, 6 -> 15/16, 8 -> 1.
TWO_BY_TWO = np.array([[1.0, 2.0], [4.0, 8.0]])
EXACT = {1.0: 1, 1.5: 2, 2.0: 1, 2.5: 2, 3.75: 4, 4.0: 1, 5.0: 2, 6.0: 2, 8.0: 1}  # out of 16
N = 200_000


def test_holm_on_three_pvalues():
    # sorted a .01, c .03, b .04: 3 x .01 = .03, 2 x .03 = .06, 1 x .04 = .04 -> running max .06
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})


def test_holm_caps_at_one_and_keeps_one_pvalue():
    assert holm({"a": 0.5, "b": 0.6}) == {"a": 1.0, "b": 1.0}
    assert holm({"only": 0.02}) == {"only": 0.02}


def test_equal_cells_collapse_the_interval():
    r = hierarchical_bootstrap(np.full((4, 3), -0.1), n_boot=2000)
    assert (r["mean"], r["low"], r["high"]) == pytest.approx((-0.1, -0.1, -0.1))
    assert r["p"] == 0.0 and (r["n_seeds"], r["n_drifts"]) == (4, 3)
    zero = hierarchical_bootstrap(np.zeros((3, 2)), n_boot=2000)
    assert zero["p"] == 1.0 and zero["low"] == zero["high"] == 0.0


def test_two_level_resamples_match_the_enumeration():
    means = two_level_means(TWO_BY_TWO, N, seed=1)
    for value, count in EXACT.items():
        assert np.mean(np.isclose(means, value)) == pytest.approx(count / 16, abs=0.005)


def test_two_level_quantiles_and_p_match_the_enumeration():
    # level 0.8: the 10% quantile lies inside the step at 1.5 (3/16 > 0.1 > 1/16), the 90% inside the step at 6
    r = hierarchical_bootstrap(TWO_BY_TWO, n_boot=N, level=0.8, seed=2)
    assert (r["mean"], r["low"], r["high"]) == pytest.approx((3.75, 1.5, 6.0), abs=1e-9)
    # shifted by 2.25: 4 of 16 resample means are <= 0, 12 >= 0 -> p = 2 x 4/16
    assert hierarchical_bootstrap(TWO_BY_TWO - 2.25, n_boot=N, seed=3)["p"] == pytest.approx(0.5, abs=0.01)


def test_pooled_draws_resampled_with_replacement():
    # one seed and one drift each: the picks (first, first), mixed, (second, second): means 1, 2, 3 w.p. 1/4, 1/2, 1/4
    r = pooled_bootstrap([np.array([[1.0]]), np.array([[3.0]])], n_boot=N, level=0.8, seed=4)
    assert (r["mean"], r["low"], r["high"]) == pytest.approx((2.0, 1.0, 3.0))
    assert r["n_draws"] == 2 and r["n_seeds"] == [1, 1]
    shifted = pooled_bootstrap([np.array([[-0.5]]), np.array([[1.5]])], n_boot=N, seed=5)
    assert shifted["p"] == pytest.approx(0.5, abs=0.01)  # 2 x P(both picks the first draw) = 2 x 1/4


def test_a_draw_chosen_twice_gets_independent_seed_resamples():
    # draw 1 seeds [0, 4], draw 2 seeds [2, 2], one drift. Both picks draw 1 (1/4): 4 seeds drawn, mean 4 Bin(4,.5)/4,
    # so 0 with 1/16; one pick each (1/2): (mean of 2 from {0,4} + 2) / 2, never 0; draw 2 twice: 2. P(0) = 1/64
    # (1/16 were the one resample reused for both picks).
    means = three_level_means([np.array([[0.0], [4.0]]), np.array([[2.0], [2.0]])], N, seed=6)
    assert np.mean(means == 0) == pytest.approx(1 / 64, abs=0.002)
    assert np.mean(means == 2) == pytest.approx(38 / 64, abs=0.005)


def test_pooled_mean_weighs_draws_equally():
    r = pooled_bootstrap([np.full((2, 2), 2.0), np.full((4, 2), 5.0)], n_boot=100)
    assert r["mean"] == pytest.approx(3.5)


def test_incomplete_or_mismatched_arrays_are_refused():
    with pytest.raises(ValueError, match="complete"):
        hierarchical_bootstrap(np.array([[1.0, np.nan]]))
    with pytest.raises(ValueError, match="same drifts"):
        pooled_bootstrap([np.zeros((2, 2)), np.zeros((2, 3))])


@pytest.mark.parametrize("mean,p,expected", [(-0.05, 0.01, HOLDS), (0.05, 0.01, DOES_NOT), (-0.05, 0.05, NOT_SEPARABLE),
                                             (-0.05, 0.2, NOT_SEPARABLE), (0.0, 0.0, NOT_SEPARABLE)])
def test_verdict(mean, p, expected):
    assert verdict({"mean": mean, "low": mean - 0.01, "high": mean + 0.01}, p) == expected


# ------------------------------------------------------------------ the manifest, on temp files

DRIFTS = ("d1", "d2")


def suite_json(version: str, init: str, seeds, grpo_minus: dict, arms=("sao", "grpo")) -> dict:
    """A suite.json with sao at 0.5 everywhere and grpo at 0.5 + grpo_minus[(seed, drift)]."""
    runs = [{"drift": d, "seed": s, "arm": a, "auc_equal_rollouts": 0.5 + (grpo_minus[(s, d)] if a == "grpo" else 0)}
            for s in seeds for d in DRIFTS for a in arms]
    return {"suite_version": version, "init_sha256": init, "reference_arm": "sao", "runs": runs}


def write_draws(tmp_path, files: dict[str, dict], versions: dict[str, str] | None = None):
    entries = []
    for name, result in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
        entries.append({"name": name, "suite_version": (versions or {}).get(name, result["suite_version"]),
                        "machine_kind": "test", "path": f"{name}.json"})
    manifest = tmp_path / "draws.yaml"
    manifest.write_text(yaml.safe_dump({"reference_arm": "sao", "draws": entries}))
    return manifest


A_DIFFS = {(0, "d1"): -0.1, (0, "d2"): -0.3, (1, "d1"): -0.2, (1, "d2"): -0.2}  # mean -0.2
B_DIFFS = {(0, "d1"): 0.0, (0, "d2"): -0.2, (1, "d1"): -0.1, (1, "d2"): -0.1}  # mean -0.1


def test_a_missing_file_names_its_draw(tmp_path):
    manifest = write_draws(tmp_path, {"a": suite_json("1.4", "x", (0, 1), A_DIFFS)})
    (tmp_path / "a.json").unlink()
    with pytest.raises(ValueError, match="draw a: no file"):
        load_draws(manifest, tmp_path)


def test_a_draw_that_is_part_of_another_is_refused(tmp_path):
    whole = suite_json("1.4", "x", (0, 1), A_DIFFS)
    part = suite_json("1.4", "x", (1,), A_DIFFS)
    manifest = write_draws(tmp_path, {"whole": whole, "part": part})
    with pytest.raises(ValueError, match="draws whole and part share 4 runs"):
        load_draws(manifest, tmp_path)


def test_same_seeds_of_another_version_or_build_are_a_new_draw(tmp_path):
    files = {"a": suite_json("1.4", "x", (0, 1), A_DIFFS), "b": suite_json("1.5", "x", (0, 1), B_DIFFS),
             "c": suite_json("1.4", "y", (0, 1), B_DIFFS)}
    _, draws = load_draws(write_draws(tmp_path, files), tmp_path)
    assert [d["name"] for d in draws] == ["a", "b", "c"]


def test_a_version_other_than_the_manifest_says_is_refused(tmp_path):
    manifest = write_draws(tmp_path, {"a": suite_json("1.4", "x", (0, 1), A_DIFFS)}, versions={"a": "1.5"})
    with pytest.raises(ValueError, match="draw a: suite_version '1.4' in the file, '1.5' in the manifest"):
        load_draws(manifest, tmp_path)


def test_a_file_without_per_run_records_is_refused(tmp_path):
    manifest = write_draws(tmp_path, {"rerun": {"suite_version": "1.4", "runs": 588}})
    with pytest.raises(ValueError, match="draw rerun: rerun.json has no per-run records"):
        load_draws(manifest, tmp_path)


def test_the_cli_pools_two_draws(tmp_path):
    manifest = write_draws(tmp_path, {"a": suite_json("1.4", "x", (0, 1), A_DIFFS),
                                      "b": suite_json("1.5", "x", (0, 1), B_DIFFS)})
    out = tmp_path / "out" / "pooled.json"
    assert main(["--manifest", str(manifest), "--root", str(tmp_path), "--n-boot", "500", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    a, b = (d["arms"]["grpo"] for d in r["per_draw"])
    assert a["hierarchical"]["mean"] == pytest.approx(-0.2) and b["hierarchical"]["mean"] == pytest.approx(-0.1)
    # the seeds-only interval is the old reports': paired_bootstrap of the per-seed means over drifts
    old = stats.paired_bootstrap([-0.2, -0.2], n_boot=500)
    assert a["seeds_only"]["low"] == pytest.approx(old["low"], abs=1e-5) and a["seeds_only"]["separates"]
    pooled = r["pooled"]["grpo"]
    assert pooled["mean"] == pytest.approx(-0.15) and pooled["draws"] == ["a", "b"]
    assert pooled["holm_p"] == pooled["p"]  # one arm: Holm changes nothing
    assert "| grpo | -0.200 | -0.100 | -0.150 [" in out.with_suffix(".md").read_text()


def test_a_draw_with_more_drifts_counts_them_alone_and_pools_over_the_shared_ones(tmp_path):
    b = suite_json("2.1", "x", (0, 1), B_DIFFS)
    b["runs"] += [{"drift": "d3", "seed": s, "arm": a, "auc_equal_rollouts": 0.5 - (0.4 if a == "grpo" else 0)}
                  for s in (0, 1) for a in ("sao", "grpo")]
    manifest = write_draws(tmp_path, {"a": suite_json("1.4", "x", (0, 1), A_DIFFS), "b": b})
    out = tmp_path / "pooled.json"
    assert main(["--manifest", str(manifest), "--root", str(tmp_path), "--n-boot", "200", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["drifts"] == ["d1", "d2"] and r["per_draw"][1]["drifts"] == ["d1", "d2", "d3"]
    # b alone: (0 - 0.2 - 0.1 - 0.1 - 0.4 - 0.4) / 6 = -0.2; pooled over d1, d2: (-0.2 + -0.1) / 2
    assert r["per_draw"][1]["arms"]["grpo"]["hierarchical"]["mean"] == pytest.approx(-0.2)
    assert r["pooled"]["grpo"]["mean"] == pytest.approx(-0.15)


def test_an_arm_without_a_pair_is_refused(tmp_path):
    broken = suite_json("1.4", "x", (0, 1), A_DIFFS)
    broken["runs"] = [r for r in broken["runs"] if not (r["arm"] == "sao" and r["seed"] == 1 and r["drift"] == "d2")]
    manifest = write_draws(tmp_path, {"a": broken})
    with pytest.raises(ValueError, match=r"grpo - sao: no pair at \(seed, drift\) \[\(1, 'd2'\)\]"):
        main(["--manifest", str(manifest), "--root", str(tmp_path), "--out", str(tmp_path / "o.json")])

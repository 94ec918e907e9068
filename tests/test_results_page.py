"""docs/results.md is what experiments.results_page renders from the committed JSON, its numbers are formatted as
written by hand below, and every file it names exists (the older versions in git at the commit it names)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from experiments import results_page as page

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / page.PAGE).read_text()


def named(prefix: str) -> list[str]:
    """The backticked names on the page's lines that start with `prefix`."""
    return [n for line in TEXT.splitlines() if line.startswith(prefix) for n in re.findall(r"`([^`]+)`", line)]


def test_the_committed_page_is_what_its_json_renders():
    assert TEXT == page.render(), "docs/results.md is stale: run .venv/bin/python -m experiments.results_page"


def test_a_section_renders_hand_written_json_exactly(tmp_path):
    mode = {"seeds": 2, "trained_per_sim_s": 20.0, "trained_per_sim_s_by_seed": [19.5, 20.5], "post_auc": 0.16292,
            "km_median_s_to_0.7": 83.826, "censored": 1}
    sync = dict(mode, mode="sync", trained_per_sim_s=8.0, trained_per_sim_s_by_seed=[7.5, 8.5], post_auc=0.00504,
                censored=2, **{"km_median_s_to_0.7": None})
    d = {"lr": 0.0004, "drift": {"name": "tool_args", "kind": "tool argument format"}, "pre": 1024, "post": 2048,
         "rate": 24.0, "learner_step_s": 2.0, "wall_s": 1603.04, "window": 64, "threshold": 0.7,
         "per_mode": [dict(mode, mode="async"), sync]}
    path = tmp_path / page.RESULTS / "sync_baselines/sync_baselines.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(d))
    lines = page.sync_section(tmp_path).splitlines()
    assert lines[0] == "## 4. Asynchronous against synchronous"
    assert lines[2] == ("SAO at lr 4e-4 on the tool argument format drift (1,024 pre- and 2,048 post-drift rollouts)"
                        " in the simulated harness, 24.0 tasks a simulated second, a learner step every 2.0 simulated"
                        " s, lognormal tool latency; asynchronous against three synchronous modes, 1,603.0 s in all."
                        " After the drift: the Kaplan-Meier median of simulated seconds to a 64-window success of 0.7.")
    assert lines[6:8] == ["| async | 2 | 20.0 (19.5, 20.5) | 1.00 | 0.163 | 83.8 | 1 of 2 |",
                          "| sync | 2 | 8.0 (7.5, 8.5) | 2.50 | 0.005 | censored | 0 of 2 |"]
    assert lines[-3:] == ["data: `docs/results/sync_baselines/sync_baselines.json`, "
                          "`docs/results/sync_baselines/sync_baselines.png`", "",
                          "older versions: `git show 4d013d6:docs/bench/sync_baselines/`"]


def test_recoveries_and_learning_rates_are_written_one_way():
    recs = {"a/format": ["recovered", 1095, 44], "b/tool": ["censored", 4000, 98], "c/string": ["unaffected", None]}
    assert page.drift_cells(recs) == ["1,095 (44)", "—", "censored (4,000)", "—"]
    grid = {"per_arm": {"sao": {"lr": 0.0004, "auc_equal_rollouts_by_lr": {"5e-05": 0.28331, "0.0004": 0.5}}}}
    assert page.lr_table(grid).splitlines()[2] == "| sao | 0.283 | 0.500 | 4e-4 |"


def test_every_file_the_page_names_exists():
    data = named("data: ")
    assert data and [n for n in data if not (ROOT / n).exists()] == []


def test_every_older_version_the_page_names_is_in_git_history():
    if subprocess.run(["git", "cat-file", "-e", f"{page.OLD}^{{commit}}"], cwd=ROOT).returncode:
        pytest.skip(f"commit {page.OLD} is not in this clone")
    old = [n.removeprefix("git show ") for n in named("older versions: ")]
    missing = [n for n in old if subprocess.run(["git", "cat-file", "-e", n.rstrip("/")], cwd=ROOT).returncode]
    assert old and missing == []


def test_the_verdicts_section_renders_hand_written_json_exactly(tmp_path):
    from experiments.results_verdicts import POOLED, verdicts_section

    arm = {"hierarchical": {"mean": -0.0123}, "seeds_only": {"separates": True},
           "verdict": "not separable at this power"}
    d = {"reference_arm": "sao", "drifts": ["a", "b"], "n_boot": 10000,
         "per_draw": [{"name": "v1", "suite_version": "1.4", "arms": {"ppo": arm}},
                      {"name": "v2", "suite_version": "2.1", "arms": {}}],
         "pooled": {"ppo": {"mean": -0.0123, "low": -0.05, "high": 0.0204, "holm_p": 0.0,
                            "verdict": "not separable at this power"}}}
    path = tmp_path / POOLED
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(d))
    lines = verdicts_section(tmp_path).splitlines()
    assert lines[0] == "## 14. The suite's verdicts over every committed draw"
    assert lines[2].startswith("Every committed main-seed draw of suites 1.4, 2.1 (")
    assert "Pooled: over the 2 drifts every draw ran" in lines[2]
    assert lines[2].endswith("these verdicts of single draws no longer separate: v1: ppo.")
    assert lines[6] == "| ppo | -0.012 | — | -0.012 [-0.050, +0.020] | < 0.0001 | not separable at this power |"


def test_the_suite2_section_renders_hand_written_json_exactly(tmp_path):
    from experiments.results_suite2 import PILOT, TUNING, suite2_section

    prior = {"per_drift": [{"drift": "swap", "start_success": 0.03125, "start_by_seed": [0.0, 0.0625],
                            "admissible": False}]}
    tried = [{"coordinate": "lr", "value": v, "score": 0.25} for v in (2e-4, 4e-4, 8e-4)] + [
        {"coordinate": "group_size", "value": n, "score": 0.3125} for n in (2, 4)] + [
        {"coordinate": "clip", "value": [0.2, c], "score": 0.3} for c in (0.1, 0.2, 0.3)]
    search = {"arm": "grpo", "chosen_setting": "lr0.0004-n4-kl0-clip0.2_0.2", "settings_run": 12, "budget": 12,
              "chosen": {"lr": 4e-4, "group_size": 4, "clip": [0.2, 0.2]}, "tried": tried}
    filled = {"seeds_rule": {"n": 9, "largest_sd_arm": "grpo", "delta": 0.05, "per_arm": {"grpo": {"sd": 0.05}}}}
    (tmp_path / PILOT).mkdir(parents=True)
    (tmp_path / TUNING).mkdir(parents=True)
    for folder, name, d in ((PILOT, "admissibility.json", prior), (PILOT, "stragglers_admissibility.json", prior),
                            (TUNING, "tuning-grpo.json", search), (TUNING, "filled.json", filled)):
        (tmp_path / folder / name).write_text(json.dumps(d))
    lines = suite2_section(tmp_path).splitlines()
    assert lines[0] == "## 15. Suite 2: its pilot"
    assert lines[6] == "| swap | 0.031 | 0.000, 0.062 | no |"
    # group sizes 2 and 4 tried, 4 chosen: the top of what was tried (2, the least a group takes, is no edge)
    assert lines[-9] == "| grpo | lr0.0004-n4-kl0-clip0.2_0.2 | 0.312 | 12 of 12 | group_size |"
    assert lines[-7] == ("Main seeds by 1.1's power rule on the chosen points' paired pilot differences: **9** "
                         "(largest SD: grpo, 0.050; delta 0.050).")
    assert lines[-5] == ("Main seeds run so far (docs/results/suite_main/v2.1/seed-<n>.json, pooled and analysed once "
                         "all have run): none (0).")


def test_the_edge_check_gives_a_row_for_each_point_past_an_edge():
    from experiments.results_suite2 import edge_rows, edge_sentence

    check = {"arms": [{"arm": "gspo", "chosen_setting": "lr0.0008-n16-kl0.1-clip0.00045_0.0006", "recorded_score": 0.4,
                       "rerun_score": 0.4, "inside": False,
                       "beyond": [{"setting": "a", "score": 0.3}, {"setting": "b", "score": 0.4375}]}]}
    assert edge_rows(check) == [["gspo", "lr0.0008-n16-kl0.1-clip0.00045_0.0006", "0.400 / 0.400", "a", "0.300", "no"],
                                ["gspo", "lr0.0008-n16-kl0.1-clip0.00045_0.0006", "0.400 / 0.400", "b", "0.438", "no"]]
    check["init_sha256"] = "ab" * 32
    assert edge_sentence(check, "cd" * 32).endswith("from the warm start of the machine it ran on (abababababab…; the "
                                                    "suite's runs: cdcdcdcdcdcd…):")
    assert edge_sentence(check, "ab" * 32).endswith("from the suite's warm start:")


def test_the_main_seeds_line_reads_the_pool_once_it_exists(tmp_path):
    from experiments.results_format import Reader
    from experiments.results_suite2 import MAIN, main_progress

    (tmp_path / MAIN).mkdir(parents=True)
    (tmp_path / MAIN / "seed-0.json").write_text("{}")
    assert main_progress(tmp_path, Reader(tmp_path)).endswith("all have run): 0 (1).")
    (tmp_path / MAIN / "suite.json").write_text(json.dumps({"runs": [{"seed": 1}, {"seed": 0}, {"seed": 1}]}))
    get = Reader(tmp_path)
    assert main_progress(tmp_path, get) == ("Main seeds: 0, 1 (2), pooled in docs/results/suite_main/v2.1/suite.json "
                                            "from one part a seed (seed-<n>.json, in git history); their verdicts: "
                                            "§16.")
    assert get.read == [MAIN / "suite.json"]  # so §15's data line names the file its seed line reads


def test_an_arm_that_repeats_another_runs_for_run_is_named_its_twin():
    from experiments.results_suite2_verdicts import twins

    def run(arm, drift, auc):
        return {"arm": arm, "drift": drift, "seed": 0, "auc_equal_rollouts": auc, "auc_equal_tokens": auc}

    main = {"runs": [run("grpo", "a", 0.3), run("grpo", "b", 0.4), run("grpo_no_kl", "a", 0.3),
                     run("grpo_no_kl", "b", 0.4), run("gspo", "a", 0.3), run("gspo", "b", 0.41)]}
    assert twins(main) == {"grpo_no_kl": "grpo"}  # gspo differs in one run


def test_the_suite2_verdicts_section_renders_hand_written_json_exactly(tmp_path):
    from experiments.results_suite2_verdicts import PARTS, SYNC, suite2_verdicts_section
    from experiments.results_verdicts import POOLED
    from experiments.suite_claims import CLAIM_PAIRS

    def r(mean, low, high, p, v):
        return {"mean": mean, "low": low, "high": high, "holm_p": p, "verdict": v}

    arms = {"outcomes": ["auc_equal_rollouts", "auc_equal_steps"], "n_boot": 10000,
            "arms": {"auc_equal_rollouts": {"sao vs grpo": r(-0.1, -0.15, -0.05, 0.0, "holds"),
                                            "sao vs ppo": r(0.01, -0.02, 0.04, 0.6, "not separable at this power")},
                     "auc_equal_steps": {"sao vs grpo": r(-0.2, -0.3, -0.1, 0.0, "holds")}}}
    def pairs(claim, eta):
        return {f"f_{b}_{eta} vs f_{w}_{eta}": r(m, m - 0.1, m + 0.1, p, "x") for (b, w), m, p in
                zip(CLAIM_PAIRS[claim], (-0.04, -0.01, -0.03, -0.02), (0.01, 0.2, 0.03, 0.04))}

    claims = {eta: {c: {"verdict": "holds" if c.startswith("single") else "does not", "pairs": pairs(c, eta)}
                    for c in CLAIM_PAIRS} for eta in ("eta4", "eta0")}
    factorial = {"outcomes": ["auc_equal_rollouts"], "n_boot": 10000, "claims": {"auc_equal_rollouts": claims}}
    cell = {"cell_collapsed_vs_start": True, "cell_collapsed_vs_frozen": False, "eta": 4, "start": 0.2, "final": 0.1,
            "frozen_final": 0.3}
    stability = {"ratio": 0.5, "quorum": 2, "cells": [{"arm": "sao", **cell}, {"arm": "ppo", **cell},
                                                      {"arm": "sao", **cell, "cell_collapsed_vs_start": False}]}
    run = {"auc_equal_rollouts": 0.5, "auc_equal_tokens": 0.5, "start_success": 0.25, "auc_equal_steps": 0.4,
           "auc_equal_compute": 0.3, "post_drift_learner_steps": 10, "drift": "a", "seed": 0}
    main = {"runs": [{"arm": "sao", **run}, {"arm": "sao", **run, "auc_equal_rollouts": 0.25, "drift": "b",
                                             "post_drift_learner_steps": 13}],
            "pooled": [{"arm": "sao", "auc_equal_rollouts": 0.375, "auc_equal_steps": 0.4, "auc_equal_compute": 0.3}]}
    sync = {"per_mode": [{"mode": "async", "seeds": 3, "post_auc": 0.163}, {"mode": "sync", "post_auc": 0.005},
                         {"mode": "sync_one_step", "post_auc": 0.362}]}
    pooled = {"pooled": {"grpo": {"verdict": "holds"}}}
    for path, d in ((PARTS["arms"], arms), (PARTS["factorial"], factorial), (PARTS["stability"], stability),
                    (PARTS["main"], main), (SYNC, sync), (POOLED, pooled)):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(json.dumps(d))
    lines = suite2_verdicts_section(tmp_path).splitlines()
    assert lines[0] == "## 16. Suite 2.1: each claim beside its verdict"
    assert lines[6] == ("| SAO adapts faster than grpo | main: sao vs grpo | -0.100 [-0.150, -0.050] | < 0.0001 "
                        "| holds | steps: holds; every draw pooled: holds |")
    assert lines[7] == ("| SAO adapts faster than PPO, each tuned (the clip alone: the factorial) | main: sao vs ppo "
                        "| +0.010 [-0.020, +0.040] | 0.6000 | not separable at this power | steps: — |")
    # the claim's 4 pairs: differences from -0.04 to -0.01, the largest Holm p 0.2
    assert lines[8] == ("| single rollout beats groups | factorial, 4 cell pairs at eta 4 | -0.040 to -0.010 | 0.2000 "
                        "| holds | eta 0: holds |")
    assert lines[11] == ("| the strict clip keeps SAO from collapsing where the others collapse | stability grid "
                         "(cells collapsed vs start/vs frozen) | sao 1/0 of 2, ppo 1/0 of 1 | — | counts (no test "
                         "registered) | — |")
    assert lines[12] == ("| asynchronous adapts faster than synchronous | §4, 3 seeds | async 0.163, sync_one_step "
                         "0.362 | — | sync_one_step higher (no test) | — |")
    # sao's pooled AUC 0.375; its two runs' start 0.25, steps (10 + 13) / 2
    assert lines[16] == "| sao | 2 | 0.375 | 0.250 | +0.125 | 0.400 | 0.300 | 11.5 |"
    # each pair named by the factors it holds fixed: the clip claim's last pair, groups of 4 without a critic
    assert lines[20] == ("| single rollout beats groups | value model, strict clip | -0.040 [-0.140, +0.060] | 0.0100 "
                         "| x | -0.040 [-0.140, +0.060] | x |")
    assert lines[31] == ("| the strict double-side clip beats the one-side clip | groups of 4, no critic | -0.020 "
                         "[-0.120, +0.080] | 0.0400 | x | -0.020 [-0.120, +0.080] | x |")
    assert lines[37] == "| sao | 4 | 2 | 1 | 0 | 0.200 | 0.100 | 0.100 |"  # the grid by arm and eta
    # half the start 0.2 and half the frozen final 0.3
    assert lines[40] == ("A cell collapses when 2 of its seeds end below 0.5 of their start or of the frozen arm's "
                         "final: on average below 0.100 or 0.150; the lowest cell ended at 0.100.")
    assert lines[42] == "Not run yet, in docs/results/suite_main/v2.1/: the straggler regime (stragglers_claims.json)."


def test_the_straggler_and_stability_tables_add_up_hand_written_rows():
    from experiments.results_suite2_verdicts import stability_rows, straggler_rows

    def cell(arm, eta, final, vs_start, vs_frozen):
        return {"arm": arm, "eta": eta, "start": 0.3, "final": final, "cell_collapsed_vs_start": vs_start,
                "cell_collapsed_vs_frozen": vs_frozen}

    grid = {"cells": [cell("sao", 0, 0.1, True, True), cell("sao", 0, 0.5, False, False),
                      cell("sao", 4, 0.4, False, False), cell("grpo", 0, 0.12, True, False)]}
    # sao at eta 0: 1 of 2 cells by each measure, final (0.1 + 0.5) / 2, its lowest 0.1
    assert stability_rows(grid) == [["sao", 0, 2, 1, 1, "0.300", "0.300", "0.100"],
                                    ["sao", 4, 1, 0, 0, "0.300", "0.400", "0.400"],
                                    ["grpo", 0, 1, 1, 0, "0.300", "0.120", "0.120"]]

    def run(arm, start, t, hit, steps):
        return {"arm": arm, "start_success": start, "sim_s_to_0.7": t, "reached_0.7_sim": hit,
                "post_drift_learner_steps": steps}

    d = {"pooled": [{"arm": "sao", "auc_equal_sim_time": 0.5, "auc_equal_rollouts": 0.6},
                    {"arm": "grpo", "auc_equal_sim_time": 0.2, "auc_equal_rollouts": 0.4}],
         "runs": [run("sao", 0.2, 100.0, True, 10), run("sao", 0.3, 300.0, True, 20), run("sao", 0.4, 900.0, False, 30),
                  run("grpo", 0.2, 800.0, False, 5)]}
    # sao: 2 of 3 runs reached 0.7, median of 100 and 300 s; the censored 900 s left out
    assert straggler_rows(d) == [["sao", 3, "0.500", "0.600", "0.300", 2, "200", "20.0"],
                                 ["grpo", 1, "0.200", "0.400", "0.200", 0, "—", "5.0"]]

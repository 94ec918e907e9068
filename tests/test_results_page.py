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
         "per_draw": [{"name": "v1", "arms": {"ppo": arm}}, {"name": "v2", "arms": {}}],
         "pooled": {"ppo": {"mean": -0.0123, "low": -0.05, "high": 0.0204, "holm_p": 0.0,
                            "verdict": "not separable at this power"}}}
    path = tmp_path / POOLED
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(d))
    lines = verdicts_section(tmp_path).splitlines()
    assert lines[0] == "## 14. The suite's verdicts over every committed draw"
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

"""docs/results.md from the committed result JSON (issue 45): the current figures, one section per result.

    .venv/bin/python -m experiments.results_page [--check]   # writes the page; --check: exit 1 with a diff if stale

Each section reads its JSON below a repository root (a test renders one from hand-written JSON), names every file it
read on its "data:" line and the older versions' place at OLD, and writes numbers as experiments.results_format does.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from experiments.arms import arm
from experiments.results_chaos import chaos_table, chaos_what
from experiments.results_format import (
    EXAMPLES,
    FAMILIES,
    OLD,
    OLD_HOME,
    PAGE,
    RESULTS,
    RUNS,
    YES,
    Reader,
    cnt,
    drift_cells,
    f3,
    lr,
    rec,
    sec,
    section,
    table,
)
from experiments.results_models import real_model_section
from experiments.results_real_model import real_model_example_section, value_options_section
from experiments.results_scale import capacity_section, transport_section
from experiments.results_suite2 import suite2_section
from experiments.results_suite2_verdicts import suite2_verdicts_section
from experiments.results_verdicts import verdicts_section
from experiments.suite_report import interval

ROOT = Path(__file__).resolve().parent.parent
SUITE = RESULTS / "suite_main/v1.6"
DEFAULT = RUNS / "default"
KL_FLOOR = DEFAULT / "2026-12-05-kl-floor"


def suite_table(res: dict) -> str:
    ref, rows = res["reference_arm"], []
    for e in res["pooled"]:
        t = e.get(f"auc_equal_rollouts_minus_{ref}_t")
        rows.append([e["arm"], arm(e["arm"]).note, lr(res["lr"][e["arm"]]) if e["arm"] in res["lr"] else "—",
                     f3(e["auc_equal_rollouts"]), interval(e.get(f"auc_equal_rollouts_minus_{ref}")),
                     f"[{t['low']:+.3f}, {t['high']:+.3f}] ({t['sd']:.3f})" if t else "", f3(e["final_reward"])])
    return table(["arm", "what it is", "lr", "post-drift AUC", f"minus {ref}, bootstrap 95%", "t 95% (SD)",
                  "final reward"], rows)


def walls_table(get: Reader) -> str:
    one, part, plan = (get(SUITE / f) for f in ("seeds-0-6-one-run.json", "walls.json", "main_plan.json"))
    (n1, n2), n3 = (sum(k.startswith("seed ") for k in d) for d in (one, part)), plan["main_seeds"]
    return table(["invocation", "seeds", "runs", "wall (s)", "a seed (s)"], [
        [f"all seeds at once ({cnt(one['equal_to_ref_runs'])} run files equal to the earlier invocations')", n1,
         cnt(one["runs"]), sec(one["wall_s"]), sec(one["wall_s"] / n1)],
        ["the budget rule's seeds, on another machine of the kind", n2, cnt(part["runs"]), sec(part["wall_s"]),
         sec(part["wall_s"] / n2)],
        [f"the plan's prediction: {sec(plan['seed_cost']['cpu_s'])} CPU-s a seed on {plan['cores']} cores, budget "
         f"{sec(plan['budget_s'])} s, the power rule's n {plan['n_rule']}", n3, "", sec(plan["predicted_wall_s"]),
         sec(plan["predicted_wall_s"] / n3)]])


def against_table(get: Reader) -> str:
    a = get(SUITE / "against-1.5-seeds-0-6.json")["auc_equal_rollouts"]
    (was, now), same = a["suite_version"], a["same_verdicts"]
    arms = {e["arm"]: e for e in a["arms"]}  # all but the reference arm
    rows = [[arm, f3(auc[0]), *([interval(dict(zip(("mean", "low", "high"), e["interval_bootstrap"]["original"]))),
                                 ", ".join(YES[e[k]["same_verdict"]] for k in ("interval_bootstrap", "interval_t"))]
                                if (e := arms.get(arm)) else ["", ""])]
            for arm, auc in a["pooled_original_replicate"].items()]
    return (f"Against {was} (warm start `{a['init_sha256'][0][:12]}…`, other code and machine kind), whose verdicts "
            f"{now} keeps for {same['interval_bootstrap']} of {a['of_arms']} arms by the bootstrap, "
            f"{same['interval_t']} by t:\n\n" + table(["arm", f"{was} AUC", f"{was} minus SAO, bootstrap 95%",
                                                       f"{now}'s verdict the same (bootstrap, t)"], rows))


def suite_section(root: Path) -> str:
    get = Reader(root)
    res = get(SUITE / "seeds-0-6.json")
    seeds = sorted({r["seed"] for r in res["runs"]})
    what = (f"Suite {res['suite']} {res['suite_version']} in the simulated harness: {cnt(len(res['runs']))} runs, "
            f"{len(res['pooled'])} arms × {res['pooled'][0]['drifts']} drifts × seeds {seeds[0]}-{seeds[-1]}, the same "
            f"tasks for every arm, warm start `{res['init_sha256'][:12]}…`. Post-drift AUC (equal rollouts): the mean "
            f"reward after the drift, pooled over the drifts; minus {res['reference_arm']}: paired over the seeds, "
            "`*` where the bootstrap interval excludes 0 (the pre-registered rule); final reward: the last "
            f"{res['window']}-rollout window. Kaplan-Meier medians per drift and arm: `seeds-0-6.md`.")
    return section(f"1. Drift suite {res['suite_version']}, {len(seeds)} seeds", what,
                   [suite_table(res), walls_table(get), against_table(get)],
                   [*get.read, SUITE / "seeds-0-6.md", SUITE / "seeds-0-6.png"], [RESULTS / "suite_main"])


def lr_table(d: dict) -> str:
    by = {arm: {float(k): v for k, v in e["auc_equal_rollouts_by_lr"].items()} for arm, e in d["per_arm"].items()}
    grid = sorted({x for v in by.values() for x in v})
    return table(["arm", *(f"lr {lr(x)}" for x in grid), "chosen"],
                 [[arm, *(f3(by[arm].get(x)) for x in grid), lr(e["lr"])] for arm, e in d["per_arm"].items()])


def lr_section(root: Path) -> str:
    get = Reader(root)
    grid, first = (get(RESULTS / "suite_pilot" / f) for f in ("v1.3/lr_grid.json", "lr_choice.json"))
    what = (f"Mean post-drift AUC (equal rollouts) per arm and learning rate on the pilot seeds "
            f"({len(grid['pilots'])} pilot files), and the lr the rule chose ({grid['rule']}); then the first "
            f"pilot's choice ({len(first['pilots'])} pilot files).")
    return section("2. Learning-rate grid", what, [lr_table(grid), lr_table(first)], get.read,
                   [RESULTS / "suite_pilot"])


def offpolicy_table(rows: list[dict]) -> str:
    return table(["arm", "η", "updates a batch", "seed", "collapsed", "reward, first → last window",
                  "median ESS fraction", "median KL (k3)", "staleness mean / max"],
                 [[r["arm"], r["eta"], r["updates"], r["seed"], YES[r["collapsed"]],
                   f"{f3(r['first_window_reward'])} → {f3(r['last_window_reward'])}", f3(r["ess_frac_median"]),
                   f3(r["kl_k3_median"]), f"{r['staleness_mean']:.1f} / {cnt(r['staleness_max'])}"] for r in rows])


def collapsed(rows: list[dict]) -> str:
    return ", ".join(f"{a} {sum(r['collapsed'] for r in rows if r['arm'] == a)} of {sum(r['arm'] == a for r in rows)}"
                     for a in dict.fromkeys(r["arm"] for r in rows))


def offpolicy_section(root: Path) -> str:
    get = Reader(root)
    sweep, stab = (get(RESULTS / "offpolicy" / f) for f in ("sweep.json", "stability-eta64-x4.json"))
    what = (f"SAO and GRPO on the stationary warm-start mixture ({sweep['families'].replace(',', ', ')}) in the "
            f"simulated harness, batches of {sweep['batch']}: {cnt(sweep['steps'])} learner steps per staleness bound "
            f"η and updates per batch, one seed a cell ({sec(sweep['wall_s'])} s), then {cnt(stab['steps'])} steps in "
            f"the harshest cell ({sec(stab['runs_wall_s'])} s of runs). Collapsed (the last {sweep['window']}-rollout "
            f"window's reward halved or the entropy collapsed): {collapsed(sweep['table'])} cells; "
            f"{collapsed(stab['table'])} seeds.")
    return section("3. Off-policy sweep and 1,000-step stability", what,
                   [offpolicy_table(sweep["table"]), offpolicy_table(stab["table"])],
                   get.read + [RESULTS / "offpolicy/sweep.png", RESULTS / "offpolicy/stability-eta64-x4.png"],
                   [RESULTS / "offpolicy"])


def sync_section(root: Path) -> str:
    get = Reader(root)
    d = get(RESULTS / "sync_baselines/sync_baselines.json")
    fast = next(m for m in d["per_mode"] if m["mode"] == "async")["trained_per_sim_s"]
    rows = [[m["mode"], m["seeds"], f"{m['trained_per_sim_s']:.1f} ("
             f"{', '.join(f'{x:.1f}' for x in m['trained_per_sim_s_by_seed'])})",
             f"{fast / m['trained_per_sim_s']:.2f}",
             f3(m["post_auc"]), sec(m["km_median_s_to_0.7"]) if m["km_median_s_to_0.7"] else "censored",
             f"{m['seeds'] - m['censored']} of {m['seeds']}"] for m in d["per_mode"]]
    what = (f"SAO at lr {lr(d['lr'])} on the {d['drift']['kind']} drift ({cnt(d['pre'])} pre- and {cnt(d['post'])} "
            f"post-drift rollouts) in the simulated harness, {d['rate']:.1f} tasks a simulated second, a learner "
            f"step every {d['learner_step_s']:.1f} simulated s, lognormal tool latency; asynchronous against three "
            f"synchronous modes, {sec(d['wall_s'])} s in all. After the drift: the Kaplan-Meier median of simulated "
            f"seconds to a {d['window']}-window success of {d['threshold']}.")
    return section("4. Asynchronous against synchronous", what, [table(
        ["mode", "seeds", "trained per simulated s (per seed)", "async ÷ mode", "post-drift AUC",
         f"median s to {d['threshold']}", "seeds reaching it"], rows)],
        [*get.read, RESULTS / "sync_baselines/sync_baselines.png"], [RESULTS / "sync_baselines"])


HARNESS = {"harness_validation_pooled_24800.json": "seeds 0-2", "harness_validation_replication.json":
           "seeds 3-5 (registered replication)", "harness_validation_six_seeds.json": "all six seeds"}


def validation_row(name: str, d: dict) -> list:
    tol, cells, real, same = d["tolerances"]["reward_abs"], d["reward_cells"], d["recovery_real"], d.get("same_batches")
    return [name, f"{sum(c['abs_diff'] <= tol for c in cells)} of {len(cells)}", f3(d["reward_abs_diff_max"]),
            f"{d['staleness_tv']:.4f}", f"{sum(d['recovery_harness'].get(k) == v for k, v in real.items())} of "
            f"{len(real)}", f"{cnt(same['identical_task_sets'])} of {cnt(same['steps_real'])}" if same else "—",
            YES[d["agree"]]]


def harness_section(root: Path) -> str:
    get = Reader(root)
    docs = {name: get(RESULTS / f) for f, name in HARNESS.items()}
    six, tol = docs["all six seeds"], docs["all six seeds"]["tolerances"]
    fams = list(dict.fromkeys(b["family"] for b in six["bias"]))
    bias = {(b["phase"], b["family"]): interval(b) for b in six["bias"]}
    what = ("Real `sao up` runs of the default scenario replayed in the simulated harness on each run's calibration. "
            f"The rule, pooled over the runs: each (phase, family) mean reward within {tol['reward_abs']} of the "
            f"pipeline's, staleness within total variation {tol['staleness_tv']}, the same recovery statuses. The "
            f"grid: harness minus pipeline per cell over the {len(six['runs'])} seeds, t 95% (`*`: excludes 0).")
    earlier = [RESULTS / "harness_validation.json", RESULTS / "harness_validation_pooled.json"]  # gone from the tree
    return section("5. The harness against the real pipeline", what, [
        table(["validation", "reward cells within tolerance", "largest difference", "staleness TV", "statuses alike",
               "steps on identical tasks", "all met"], [validation_row(n, d) for n, d in docs.items()]),
        table(["phase", *fams], [[p, *(bias[p, f] for f in fams)] for p in sorted({p for p, _ in bias})])],
        get.read, earlier + get.read)


def floor_table(runs: dict) -> str:
    """Per seed and anchor: new-tool-first share over the last 512 tool tasks before the rename, the rename, wall."""
    anchors = {tuple(r["sets"]): " ".join(r["sets"]) or "defaults" for r in runs.values()}
    by = {(tuple(r["sets"]), r["seed"]): r for r in runs.values()}
    rows = [[s, *(c for a in anchors for c in (f"{100 * by[a, s]['find_first_last512_before']:.1f}%",
                                               rec(**by[a, s]["rename"]), sec(by[a, s]["wall_s"])))]
            for s in sorted({r["seed"] for r in runs.values()})]
    return table(["seed", *(c for n in anchors.values() for c in (f"{n}: new tool first", "rename", "wall (s)"))], rows)


def kl_parts(get: Reader) -> list[str]:
    pipes = {a: get(KL_FLOOR / f"pipeline-{a}.json") for a in ("k3", "forward")}
    seeded = get(DEFAULT / "2026-12-04-kl-anchor/runs.json")
    runs = [(n, "—", a, r) for a, p in pipes.items() for n, r in p.items()]
    runs += [(n, seeded["warm_start"][n], seeded["anchor"][n], r) for n, r in seeded["runs"].items()]
    return ["The KL anchor to the warm start, k3 on the sampled tokens (the default, 0.1) against the forward KL over "
            "the next-token distribution: phases 0-2 of the default scenario in one process, then unseeded (one "
            "machine and day) and seeded (two warm-start builds) `sao up` runs of the whole scenario.",
            floor_table(get(KL_FLOOR / "runs.json")), table(["run", "warm start", "anchor", "AUC", *FAMILIES], [
                [Path(n).name, ws, a, f3(r["auc"]), *drift_cells(r["recoveries"])] for n, ws, a, r in runs])]


def default_section(root: Path) -> str:
    get = Reader(root)
    d, c = get(DEFAULT / "default_runs.json"), get(DEFAULT / "2026-12-05-fresh-clone-13fd1ff-avx2/summary.json")
    w = get(DEFAULT / "pretrain-760-bb8b624.json")
    by, n, h = c["recovery_summary"]["by_status"], c["recovery_summary"]["n"], w["history"][-1]
    fams = [k for k in h if k.startswith("reward/")]
    what = (f"`sao up` on its defaults on {d['machine']['cpus']} cores, seeds "
            f"{', '.join(str(r['seed']) for r in d['runs'])}, from the warm start of the third table, then a fresh "
            "clone's `make up` with its own warm-start build. A drift's recovery: the drifted family's trajectories "
            "until its window is back within δ of the pre-drift level (learner steps).")
    parts = [table(["seed", "wall (s)", *FAMILIES, "recovered"], [[r["seed"], sec(r["wall_s"]), *drift_cells(
                 r["drifts"]), f"{r['recovered']} of {r['drifted']}"] for r in d["runs"]]),
             table(["trajectories", "learner steps", "AUC", "trajectories/s", "trained", *FAMILIES, "recovered"], [[
                 cnt(c["n_trajectories"]), cnt(c["n_learner_steps"]), f3(c["auc"]), f"{c['trajectories_per_s']:.1f}",
                 f3(c["trained_fraction"]), *drift_cells(c["recoveries"]), f"{by['recovered']} of "
                 f"{n - by['unaffected']}"]]),
             table(["warm-start steps", "training (s)", "CPU (s)", "threads", "held-out greedy reward",
                    *(k.split("/")[1] for k in fams)], [[cnt(h["step"]), sec(h["seconds"]), sec(h["cpu_seconds"]),
                                                         max(t[1] for t in w["threads"]), f3(h["reward"]),
                                                         *(f3(h[k]) for k in fams)]]), *kl_parts(get)]
    png = [DEFAULT / "reward_by_phase.png", DEFAULT / "2026-12-05-fresh-clone-13fd1ff-avx2/dashboard.png"]
    return section("6. `sao up` on the default scenario, and the KL anchor", what, parts, get.read + png, [DEFAULT])


def speed_rows(c: dict[str, dict]) -> list[list]:
    ls, tr, rp, db, mega = (c[f"{f}.json"] for f in ("learner_step", "transport", "replay", "dashboard",
                                                      "megatron_learner_step"))
    return [["learner_step.json", "SAO step (policy + value) ÷ bare forward+backward",
             f"{ls['ratio_sao_over_bare']:.3f} (load {ls['load_avg_1m']:.1f})", f"≤ {ls['goal_ratio_max']}"],
            *[[f, f"sampler ÷ `transformers.generate`, {c[f].get('architecture', 'the tiny Qwen3-MoE')}, batch "
               f"{' / '.join(str(r['batch']) for r in c[f]['rows'])} × {c[f]['rows'][0]['max_new_tokens']} tokens",
               " / ".join(f"{r['speedup']:.2f}x" for r in c[f]["rows"]) + f" (load {c[f]['load_avg_1m']:.1f})",
               f"≥ {c[f]['goal_speedup_min']}x"]
              for f in ("sampler.json", "sampler_qwen3.json", "sampler_glm4_moe.json")],
            ["transport.json", f"broker, {tr['tokens_per_trajectory']}-token trajectories ({tr['auto_compression']})",
             f"produce {cnt(tr['produce']['auto']['per_s'])}/s, consume {cnt(tr['consume']['auto']['per_s'])}/s",
             "≥ 5,000/s each way"],
            ["transport.json", "agent transport overhead per trajectory",
             f"{100 * tr['overhead_fraction_of_agent_time']:.1f}% ({tr['agent_path']['median_ms']:.2f} ms of "
             f"{tr['agent_rollout']['median_ms']:.1f} ms)", "≤ 5%"],
            ["transport.json", f"a policy announcement until {tr['propagation']['agents']} agents use it",
             f"{tr['propagation']['max_s']:.2f} s max", "≤ 2 s"],
            ["replay.json", f"replay of {cnt(rp['tasks'])} tasks at `--speed {rp['speed']:.0f}`",
             f"{cnt(rp['tasks_per_s'])} tasks/s, keeps up: {YES[rp['keeps_up']]}, peak RSS {rp['peak_rss_mb']:.1f} MB",
             f"{cnt(rp['required_tasks_per_s'])} tasks/s"],
            ["dashboard.json", f"dashboard page of a {cnt(db['trajectories'])}-trajectory run, cold",
             f"{sec(db['cold_server_cold_browser']['all_charts_s'])} s (load {db['loadavg_1m_before']:.1f})",
             f"< {sec(db['goal_s'])} s"],
            ["metrics_app.json", "faust metrics app, steady", f"{cnt(c['metrics_app.json']['steady_traj_per_s'])} "
             "trajectories/s", "—"],
            *[[f, f"sampler/learner log-prob mismatch, {c[f]['engine']} engine",
               f"mean abs {c[f]['mean_abs_diff']:.1e}, max {c[f]['max_abs_diff']:.1e}", "—"]
              for f in ("logprob_mismatch_torch.json", "logprob_mismatch_hf.json")],
            ["megatron_learner_step.json", " / ".join(r["backend"] for r in mega["rows"]), " / ".join(
                cnt(r["tokens_per_s"]) for r in mega["rows"]) + f" tokens/s (load {mega['load_avg_1m']:.1f})", "—"]]


def learning_rows(c: dict[str, dict]) -> list[list]:
    ws, pre, p = c["warmstart_step.json"], c["pretrain.json"], c["pipeline.json"]
    f, pl, iso, goal = p["figures"], p["pipeline"], p["isolated"], p["goals"]
    return [["pretrain.json", "warm start to 90% held-out greedy reward; its sampled full reward right after each "
             "drift", f"step {pre['time_to_90pct']['step']}, {sec(pre['time_to_90pct']['cpu_seconds'])} CPU-s; "
             + ", ".join(f"{d['family']} {f3(d['sampled_full_after'])}" for d in pre["drifts"]), "—"],
            ["warmstart_step.json", "warm-start step after ÷ before (CPU on 1 thread, wall on 2)",
             f"{ws['cpu_1_thread']['ratio']:.3f}, {ws['wall_2_threads']['ratio']:.3f}", "—"],
            ["lr_probe.json", "`sao up` reward per 100 trajectories, first → last", ", ".join(
                f"lr {lr(r['lr'])} {f3(r['reward_per_100'][0])} → {f3(r['reward_per_100'][-1])}"
                for r in c["lr_probe.json"]["runs"]), "—"],
            *[["value_ablation.json", f"value model, {r['name']}: recovered after; phase-1 reward; first policy-step "
               "loss", ", ".join(f"{x['concept']} {rec(**x)}" for x in r["recoveries"]) +
               f"; {f3(r['mean_reward_phase1'])}; {f3(r['first_policy_step_loss'])}", "—"]
              for r in c["value_ablation.json"]["runs"]],
            ["pipeline.json", "inside `sao up`: trained ÷ generated; learner busy share; learner steps per 1,000 "
             "trajectories", f"{f['trained_fraction']:.4f} ({cnt(pl['trajectories_trained'])} of "
             f"{cnt(pl['trajectories_generated'])}); {f3(f['learner_busy_share'])}; "
             f"{f['learner_steps_per_1000_trajectories']:.1f}", f"≥ {goal['trained_fraction']['goal']}"],
            ["pipeline.json", "inside `sao up`: learner tokens/s ÷ its step alone on the run's lengths (on a fixed "
             "synthetic batch)", f"{cnt(pl['learner_tokens_per_s'])} ÷ {cnt(iso['tokens_per_s'])} = "
             f"{f3(f['tokens_per_s_ratio'])} ({cnt(iso['fixed_batch']['tokens_per_s'])}: "
             f"{f3(f['tokens_per_s_ratio_fixed_batch'])})", f"≥ {goal['tokens_per_s_ratio']['goal']}"]]


def suite_cut_rows(get: Reader) -> list[list]:
    runs = [(Path(n).stem.split("-")[1], ", ".join(sorted({r["drift"] for r in d["runs"]})), d,
             get(RESULTS / "critic_depth" / f"walls-{n}")["sao_like"])
            for n, d in get.glob(RESULTS / "critic_depth", "layers-*.json").items()]
    base = {drifts: w["run_wall_s"] for blocks, drifts, _, w in runs if blocks == "4"}
    rows = [["critic_depth/", f"SAO, a critic of the policy's first {blocks} of 4 blocks, {drifts} ({w['runs']} "
             "runs): AUC; run walls (s), ÷ 4 blocks'", f"{f3(d['pooled'][0]['auc_equal_rollouts'])}; "
             f"{sec(w['run_wall_s'])}, {f3(w['run_wall_s'] / base[drifts])}", "—"] for blocks, drifts, d, w in runs]
    for name in ("learner_scored_only", "shared_prefill"):
        (_, ab), (_, after), (_, before) = get.glob(RESULTS / name, "*.json").items()  # ab-*, seed-2-after, -before
        s = ab["seed 2"]
        rows.append([f"{name}/", f"seed 2 before → after ({s['runs']} runs): run walls (s); train, generate "
                     "sections; AUC", f"{sec(s['run_wall_s_old'])} → {sec(s['run_wall_s_new'])} ({f3(s['ratio'])}); "
                     f"{f3(s['section_ratio']['train'])}, {f3(s['section_ratio']['generate'])}; " + ", ".join(
                         f"{b['arm']} {f3(b['auc_equal_rollouts'])} → {f3(a['auc_equal_rollouts'])}"
                         for b, a in zip(before["pooled"], after["pooled"])), "—"])
    return rows


def components_section(root: Path) -> str:
    get = Reader(root)
    c = get.glob(RESULTS / "components", "*.json") | {f: get(RESULTS / f) for f in (
        "sampler_qwen3.json", "sampler_glm4_moe.json", "warmstart_step.json", "pipeline.json")}
    what = ("Each component alone on a 2-core machine shared with other jobs (throughput figures are lower bounds "
            "that move with the load each JSON records); then the warm start, the value model and the learner inside "
            "`sao up`; then the critic's depth (SAO, the suite's pilot seeds) and the learner's last layer on the "
            "scored tokens alone and the shared prefill of a group's identical prompts (the suite's seed 2).")
    rows = speed_rows(c) + learning_rows(c) + suite_cut_rows(get)
    png = [RESULTS / f for f in ("components/dashboard.png", "components/value_ablation.png", "pipeline.png")]
    return section("7. Component speeds", what, [table(["file", "what", "measured", "goal"], rows)], get.read + png,
                   [RESULTS / "components", RESULTS / "critic_depth", RESULTS / "pipeline.json"])


def deployment_tables(ch: dict, co: dict, ci: dict) -> list[str]:
    return [chaos_table(ch),
            table(["`docker compose up`", "image (MB)", "build (s)", "to first trained step (s)", "then",
                   "learner steps", *FAMILIES], [
                ["defaults, embedded broker", cnt(co["image_mb"]), sec(co["build_seconds"]),
                 sec(co["up_to_first_trained_step_s"]), f"last full batch at {sec(co['up_to_last_full_batch_s'])} s, "
                 f"{cnt(co['scenario_tasks'])} tasks", cnt(co["learner_steps"]),
                 *drift_cells(co["summary"]["recoveries"])],
                ["the CI test, from nothing", "", sec(ci["build_seconds"]), sec(ci["up_to_first_trained_step_s"]),
                 f"learner killed at step {ci['killed_at_step']}, resumed at {ci['resumed_at_step']}; "
                 f"{cnt(ci['trained'])} of {cnt(ci['trajectories'])} trained", cnt(ci["learner_steps"]),
                 *("" for _ in FAMILIES)]])]


def own_model_row(name: str, r: dict) -> list:
    x = next(x for x in r["recoveries"] if x["status"] != "unaffected")
    last = [v for k, v in r["reward_by_phase"].items() if k.startswith(f"{x['family']}/{x['concept']} ")][-1]
    return [name, r["architecture"], r["finetune"]["demonstrations"], sec(r["finetune"]["seconds"]),
            f"{f3(x['pre_level'])} → {f3(x['initial_level'])}", rec(**x), f3(last["last64"]), f3(r["trained_fraction"])]


def reliability_section(root: Path) -> str:
    get = Reader(root)
    ch, co, ci = (get(RESULTS / f) for f in ("chaos.json", "compose.json", "compose_up_ci.json"))
    m = get(EXAMPLES / "own-model/measured.json")
    what = (f"{chaos_what(ch)} Then `docker compose up` to the learner's first trained step, and what that run "
            f"recovered; your own model: {m['stream']}, {m['machine']}.")
    own = table(["run", "architecture", "demonstrations", "fine-tune (s)", "pre-drift → first window",
                 "recovered after", "last 64", "trained"], [own_model_row(n, r) for n, r in m["runs"].items()])
    png = [RESULTS / "compose_dashboard.png", RESULTS / "dashboard-ess-own-model.png"]
    return section("8. Reliability, deployment and your own model", what, [*deployment_tables(ch, co, ci), own],
                   get.read + png, get.read[:3])


SECTIONS = (suite_section, lr_section, offpolicy_section, sync_section, harness_section, default_section,
            components_section, reliability_section, transport_section, capacity_section, real_model_section,
            real_model_example_section, value_options_section, verdicts_section,
            suite2_section, suite2_verdicts_section)


def render(root: Path = ROOT) -> str:
    head = (f"Generated by `python -m experiments.results_page` from the JSON named under each section; do not edit "
            f"by hand.\n\n# Results\n\nThe current figures, one section per result; older versions of every file are "
            f"in git history, at `git show {OLD}:{OLD_HOME[RESULTS]}/` and `git show {OLD}:{OLD_HOME[RUNS]}/`.")
    return "\n\n".join([head, *(s(root) for s in SECTIONS)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 with a diff when the committed page differs")
    page, text = ROOT / PAGE, render()
    if not p.parse_args(argv).check:
        page.write_text(text)
        return 0
    old = page.read_text().splitlines(True) if page.exists() else []
    sys.stdout.writelines(diff := list(difflib.unified_diff(old, text.splitlines(True), str(PAGE), "render()")))
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())

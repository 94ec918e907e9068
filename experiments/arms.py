"""The arms of the drift suite (issue 15, item 3): each a LearnerConfig override list, a group size and the harness
settings it changes. A suite names arms; an unknown name is refused with the known ones listed.

Interpretations written down here, since the issue names them in words:
- "without critic warm-up": no critic-only steps at the start (value.warmup_steps=0) nor after a value-loss spike
  (value.rewarm_steps=0): both are the warm-up mechanism.
- "with coupled lambda": lam_actor = lam_critic = 0.95 (the usual PPO setting; the critic then learns biased GAE
  targets instead of Monte-Carlo returns), as the earlier drift_algorithms experiment's ablation.
- "without the strict clip binding": the SAO loss with a band so wide it never binds (eps_low 1.0: r >= 0 always;
  eps_high 10: r <= 11), i.e. the importance-weighted policy gradient without a trust region.
- "frozen (lr 0)": LearnerConfig refuses optim.lr=0 (it must be > 0), so the frozen control runs no learner step at
  all (SimConfig.train=False): the same stream, engine and verifiers, the warm-start policy throughout.
- "eta=0": SAO with the staleness bound 0: only trajectories of the learner's current version are trained.

The factorial isolating SAO's three claims (issue 49, item 2): {single rollout, group of n} x {value model, outcome
baseline} x {strict double-side clip (loss sao), one-side clip (loss ppo)}, each cell at eta 0 and eta 4
(`factorial_arms`; named f_<rollout>_<baseline>_<clip>_eta<eta>, e.g. f_single_value_strict_eta4 = the sao arm at
eta 4, f_group4_base_oneside_eta4 = GRPO with n = 4):
  rollout   single: group_size 1; group<n>: n rollouts of each task (n = 4 by default)
  baseline  value: the critic's GAE (advantage.estimator=gae; with groups every member is scored by the critic alone)
            base: no critic; single rollouts: reinforce_pp ((R - batch mean) / batch std, REINFORCE++), groups: grpo
  clip      strict: loss.name=sao; oneside: loss.name=ppo (the same 0.2 band; PPO's pessimistic min clips only the
            side the advantage's sign pushes the ratio toward)

Which pairs answer which claim (each pair differs in its one factor; every pair at eta 0 and at eta 4, the same seeds):
  claim                                     pairs (A vs B)                                    held fixed
  1 single rollout beats groups             f_single_value_strict  vs f_group4_value_strict   value model, strict
                                            f_single_value_oneside vs f_group4_value_oneside  value model, one-side
                                            f_single_base_strict   vs f_group4_base_strict    no critic, strict
                                            f_single_base_oneside  vs f_group4_base_oneside   no critic, one-side
  2 a value model beats a group baseline    f_group4_value_strict  vs f_group4_base_strict    groups, strict
                                            f_group4_value_oneside vs f_group4_base_oneside   groups, one-side
                                            f_single_value_strict  vs f_single_base_strict    single, strict
                                            f_single_value_oneside vs f_single_base_oneside   single, one-side
  3 the strict double-side clip beats       f_single_value_strict  vs f_single_value_oneside  single, value model
    the one-side clip                       f_single_base_strict   vs f_single_base_oneside   single, no critic
                                            f_group4_value_strict  vs f_group4_value_oneside  groups, value model
                                            f_group4_base_strict   vs f_group4_base_oneside   groups, no critic
Caveats on reading it: in the no-critic row the baseline changes with the rollout factor (a batch's mean for single
rollouts, a group's for n), so claim 1's two "base" pairs compare the two critic-free designs, not n alone; claim 2's
single-rollout pairs pit the critic against REINFORCE++'s batch baseline, the groups pairs against GRPO's group one
(the claim as stated). At eta 0 with one update per batch every trajectory is scored at its behaviour weights (ratio
~1: numerics, and the nucleus mass when top_p < 1), so neither clip should bind there: claim 3's eta-0 pairs are a
near-null control, the eta-4 pairs the test.
A group arm sees ceil(k/n) tasks of a phase for k single rollouts (suite_runs.phase_prefix): equal rollouts, fewer
tasks. rloo_n2 and rloo_n4 (estimator rloo, loss ppo, at the suite's eta) place a leave-one-out group baseline at
small n beside the factorial's GRPO cells.

The factorial's arms live in SUITE2_ARMS, not ARMS: ARMS is drift_v1's own list (drift_v1.yaml names every arm in it,
tests/test_harness.py), and `arm`/`arms`, what a suite YAML's names go through, look up both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GROUP = 8
_GAE = ("advantage.estimator=gae",)
_GRPO = ("advantage.estimator=grpo",)


@dataclass(frozen=True)
class Arm:
    name: str
    learner: tuple[str, ...]  # LearnerConfig overrides (KEY=VALUE)
    group_size: int = 1
    sim: dict[str, object] = field(default_factory=dict)  # SimConfig fields this arm sets (eta, train)
    note: str = ""


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("sao", ("loss.name=sao", *_GAE), note="single rollout, value model, strict double-side clip"),
    Arm("ppo", ("loss.name=ppo", *_GAE), note="one-side (PPO) clip, otherwise SAO"),
    Arm("sao_no_warmup", ("loss.name=sao", *_GAE, "value.warmup_steps=0", "value.rewarm_steps=0"),
        note="no critic-only warm-up, at the start or after a value-loss spike"),
    Arm("sao_coupled_lambda", ("loss.name=sao", *_GAE, "advantage.lam_actor=0.95", "advantage.lam_critic=0.95"),
        note="lam_actor = lam_critic = 0.95"),
    Arm("sao_no_strict_clip", ("loss.name=sao", *_GAE, "loss.eps_low=1.0", "loss.eps_high=10.0"),
        note="the SAO band widened until it never binds"),
    Arm("grpo", ("loss.name=ppo", *_GRPO), GROUP, note=f"groups of {GROUP}, (R - mean)/std, PPO clip"),
    Arm("dapo", ("loss.name=dapo", *_GRPO, "advantage.dynamic_sampling=true"), GROUP,
        note="clip-higher, dynamic sampling (uniform groups dropped)"),
    Arm("dr_grpo", ("loss.name=ppo", "advantage.estimator=dr_grpo"), GROUP, note="R - mean, no std"),
    Arm("gspo", ("loss.name=gspo", *_GRPO), GROUP, note="sequence-level ratio and clip"),
    Arm("cispo", ("loss.name=cispo", *_GRPO), GROUP, note="clipped stop-gradient IS weight"),
    Arm("frozen", ("loss.name=sao", *_GAE), sim={"train": False}, note="control: no learner step"),
    Arm("eta0", ("loss.name=sao", *_GAE), sim={"eta": 0}, note="control: staleness bound 0"),
)}


FACTORIAL_N = 4  # rollouts per task in the factorial's group cells
_CLIPS = {"strict": "loss.name=sao", "oneside": "loss.name=ppo"}


def factorial_arms(etas: tuple[int, ...] = (0, 4), n: int = FACTORIAL_N) -> list[Arm]:
    """The 8 cells of the factorial at each eta in `etas` (see the module's docstring), named
    f_{single|group<n>}_{value|base}_{strict|oneside}_eta<eta>, each setting SimConfig.eta itself."""
    if n < 2:
        raise ValueError(f"factorial_arms: n {n} must be >= 2 (the group cells' rollouts per task)")
    out = []
    for eta in etas:
        for rollout, size in (("single", 1), (f"group{n}", n)):
            for baseline, estimator in (("value", "gae"), ("base", "reinforce_pp" if size == 1 else "grpo")):
                for clip, loss in _CLIPS.items():
                    out.append(Arm(f"f_{rollout}_{baseline}_{clip}_eta{eta}",
                                   (loss, f"advantage.estimator={estimator}"), size, sim={"eta": eta},
                                   note=f"factorial: {rollout}, {estimator}, {loss.split('=')[1]} loss, eta {eta}"))
    return out


# DAPO's overlong shaping: the suite's answers are at most 32 tokens a turn (AgentSettings.max_new_tokens); a buffer
# of 8 (the paper's L_cache / L_max is 0.2) penalises 25-32 tokens linearly, down to -1
_OVERLONG = ("advantage.overlong.max_tokens=32", "advantage.overlong.buffer=8")

# The arms drift_v2 adds (issue 49): the factorial, small-n RLOO, REINFORCE++, DAPO as in its paper and its parts
# alone on GRPO, and the stability grid's dual clip and decoupled PPO. Kept apart from ARMS, drift_v1's own list.
SUITE2_ARMS: dict[str, Arm] = {a.name: a for a in (
    *factorial_arms(),
    Arm("rloo_n2", ("loss.name=ppo", "advantage.estimator=rloo"), 2, note="groups of 2, leave-one-out mean, PPO clip"),
    Arm("rloo_n4", ("loss.name=ppo", "advantage.estimator=rloo"), 4, note="groups of 4, leave-one-out mean, PPO clip"),
    Arm("reinforce_pp", ("loss.name=ppo", "advantage.estimator=reinforce_pp"),
        note="single rollout, (R - batch mean) / batch std, PPO clip"),
    Arm("dapo_paper", ("loss.name=dapo", *_GRPO, "loss.kl_coef=0", "loss.agg=token_mean",
                       "advantage.dynamic_sampling=true", *_OVERLONG), GROUP,
        note="DAPO as in its paper: no KL, clip-higher 0.2/0.28, dynamic sampling, overlong shaping 32/8"),
    Arm("grpo_no_kl", ("loss.name=ppo", *_GRPO, "loss.kl_coef=0"), GROUP, note="GRPO without the KL penalty"),
    Arm("grpo_clip_higher", ("loss.name=ppo", *_GRPO, "loss.eps_high=0.28"), GROUP, note="GRPO with eps_high 0.28"),
    Arm("grpo_dynamic_sampling", ("loss.name=ppo", *_GRPO, "advantage.dynamic_sampling=true"), GROUP,
        note="GRPO dropping groups of equal rewards"),
    Arm("grpo_overlong", ("loss.name=ppo", *_GRPO, *_OVERLONG), GROUP, note="GRPO with overlong shaping 32/8"),
    Arm("dual_clip", ("loss.name=dual_clip", *_GAE), note="SAO with PPO's dual clip (c = 3)"),
    Arm("decoupled_ppo", ("loss.name=decoupled_ppo", *_GAE), note="SAO with decoupled PPO's proximal policy"),
)}
_KNOWN: dict[str, Arm] = {**ARMS, **SUITE2_ARMS}


def setting_of(a: Arm, key: str, default: str) -> str:
    """The value the arm's overrides give `key` (the last one wins), else `default`."""
    return next((x.split("=", 1)[1] for x in reversed(a.learner) if x.startswith(f"{key}=")), default)


def with_setting(a: Arm, point: dict, name: str | None = None) -> Arm:
    """The arm at a tuned setting (experiments.suite_tune): its KL coefficient, clip band and its group size when it
    has groups; `point["lr"]` is the suite's to apply (`lr_of`)."""
    lo, hi = point["clip"]
    sets = [*a.learner, f"loss.kl_coef={point['kl']}", f"loss.eps_low={lo}", f"loss.eps_high={hi}"]
    return replace(a, name=name or a.name, learner=tuple(sets),
                   group_size=point["group_size"] if a.group_size > 1 else a.group_size)


def laid_over(a: Arm, source: Arm, point: dict) -> Arm:
    """`a` at `source`'s tuned point with its own difference from `source` laid over it: the learner settings `a`
    has and `source` lacks come last (they win: sao_no_strict_clip keeps its open band, grpo_clip_higher its 0.28),
    and its group size where it differs from `source`'s (a factorial cell's 4), else the tuned one."""
    base = with_setting(source, point)
    own = [s for s in a.learner if s not in source.learner]
    size = a.group_size if a.group_size != source.group_size else base.group_size
    return replace(a, learner=(*base.learner, *own), group_size=size)


def arm(name: str) -> Arm:
    if name not in _KNOWN:
        raise ValueError(f"unknown arm '{name}'; known arms: {', '.join(_KNOWN)}")
    return _KNOWN[name]


def arms(names: list[str]) -> list[Arm]:
    """The arms a suite names, in its order; every unknown name is refused at once."""
    unknown = [n for n in names if n not in _KNOWN]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known arms: {', '.join(_KNOWN)}")
    return [_KNOWN[n] for n in names]

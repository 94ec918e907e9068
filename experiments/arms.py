"""The arms of the drift suite (issue 15, item 3): each a LearnerConfig override list, a group size and the harness
settings it changes. A suite names arms; an unknown name is refused with the known ones listed.

Interpretations written down here, since the issue names them in words:
- "without critic warm-up": no critic-only steps at the start (value.warmup_steps=0) nor after a value-loss spike
  (value.rewarm_steps=0): both are the warm-up mechanism.
- "with coupled lambda": lam_actor = lam_critic = 0.95 (the usual PPO setting; the critic then learns biased GAE
  targets instead of Monte-Carlo returns), as experiments/drift_algorithms.py's ablation.
- "without the strict clip binding": the SAO loss with a band so wide it never binds (eps_low 1.0: r >= 0 always;
  eps_high 10: r <= 11), i.e. the importance-weighted policy gradient without a trust region.
- "frozen (lr 0)": LearnerConfig refuses optim.lr=0 (it must be > 0), so the frozen control runs no learner step at
  all (SimConfig.train=False): the same stream, engine and verifiers, the warm-start policy throughout.
- "eta=0": SAO with the staleness bound 0: only trajectories of the learner's current version are trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def arm(name: str) -> Arm:
    if name not in ARMS:
        raise ValueError(f"unknown arm '{name}'; known arms: {', '.join(ARMS)}")
    return ARMS[name]


def arms(names: list[str]) -> list[Arm]:
    """The arms a suite names, in its order; every unknown name is refused at once."""
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known arms: {', '.join(ARMS)}")
    return [ARMS[n] for n in names]

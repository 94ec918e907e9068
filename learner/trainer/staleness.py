"""Which trajectories the learner accepts: de-duplication, validity and the staleness bound.

staleness = learner version at training time - the trajectory's `policy_version` (the oldest
version that generated any of its tokens), both counted on the learner's lineage (`Lineage`): a
learner started over an older store publishes the weights of an early index under a new number, so
version numbers alone would make the trajectories it reads look older than they are. A trajectory
more than `max_staleness` versions behind is dropped and counted; it is checked on arrival and again
when its batch is trained, since it may wait in the buffer while versions advance. A GRPO-family group
goes stale as a whole (its oldest member decides).

A greedy trajectory (`temperature` <= 0) is dropped as 'greedy': argmax decoding is not a sample of
any distribution the learner can score, so it has no policy ratio (its recorded log-probs are the
model's at temperature 1, which would make the ratio 1 and the update a biased one).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from streamer.wire.schema import Trajectory


class Lineage:
    """Published version numbers -> lineage index (how many publication points of the surviving history lie
    behind that version's weights). Numbers only grow, so agents always move forward; the index is what
    staleness counts. Without a new start, index == number: a learner resumed from its checkpoint redoes the
    lost steps under the numbers they had (`Trainer.start`). A learner started afresh over a store that already
    holds versions up to L publishes its initial weights as L + 1 with index 0: an anchor (L + 1, 0)."""

    def __init__(self, anchors: list[list[int]] | None = None) -> None:
        self.anchors: list[tuple[int, int]] = [(int(n), int(i)) for n, i in anchors or []]  # (number, index)
        # the newest number this process published (`anchor` sees every publication); None before its first:
        # without a publisher, or while a resumed learner redoes steps whose versions the agents already hold
        self.newest: int | None = None

    def index(self, number: int) -> int:
        for n, i in reversed(self.anchors):
            if number >= n:
                return i + (number - n)
        return number

    def anchor(self, number: int, index: int) -> None:
        """Version `number` holds the weights of lineage `index` (recorded only where it breaks the pattern)."""
        self.newest = number if self.newest is None else max(self.newest, number)
        if self.index(number) != index:
            self.anchors.append((number, index))


def staleness(t: Trajectory, version_index: int, lineage: Lineage | None = None) -> int:
    """`version_index`: the learner's lineage index (its version number when it never restarted)."""
    return version_index - (t.policy_version if lineage is None else lineage.index(t.policy_version))


def histogram(trajs: list[Trajectory], version_index: int, lineage: Lineage | None = None) -> dict[str, int]:
    """Staleness (as a string, the LearnerEvent format) -> count."""
    return {str(k): v for k, v in sorted(Counter(staleness(t, version_index, lineage) for t in trajs).items())}


def invalid_reason(t: Trajectory, vocab_size: int | None = None, max_tokens: int | None = None,
                   newest: int | None = None) -> str | None:
    """Why a trajectory cannot be trained on (None when it can). With the model's `vocab_size` and
    `max_tokens` (its positions), token ids and lengths the forward pass would crash on are refused here,
    before the trajectory can enter the buffer or a checkpoint; with `newest` (the newest version this
    learner published), a trajectory claiming a version from the future. Decoding checked the rest of
    its meaning (`Trajectory.validate`); it is checked again for trajectories that did not come from bytes."""
    try:
        t.validate()
    except ValueError as e:
        return str(e)
    if max_tokens is not None and len(t.tokens) > max_tokens:
        return f"Trajectory.tokens: {len(t.tokens)} tokens > the model's {max_tokens} positions"
    if vocab_size is not None:
        bad = next((i for i, x in enumerate(t.tokens) if not 0 <= x < vocab_size), None)
        if bad is not None:
            return f"Trajectory.tokens[{bad}]: id {t.tokens[bad]} outside the vocabulary 0..{vocab_size - 1}"
    claimed = max([t.policy_version, *t.policy_versions])
    if newest is not None and claimed > newest:
        return f"Trajectory.policy_version: {claimed} is newer than the newest version this learner published " \
               f"({newest})"
    if not any(t.loss_mask[max(1, t.prompt_len):]):
        return "Trajectory.loss_mask: no generated token after the prompt"
    return None


class Admission:
    """Decides, per arriving trajectory, 'ok' or the reason it is dropped; counts each reason.

    De-duplication key: the task id (single rollout: one trajectory per task), or (group id,
    trajectory id) for group estimators and for members of group rollouts (the agent's trajectory
    id is "<task>:<member>"). The last `window` keys are remembered (and checkpointed)."""

    def __init__(self, max_staleness: int, grouped: bool = False, window: int = 100_000,
                 sync: bool = False, vocab_size: int | None = None, max_tokens: int | None = None) -> None:
        self.max_staleness = 0 if sync else max_staleness
        self.vocab_size, self.max_tokens = vocab_size, max_tokens
        self.lineage = Lineage()
        # True for a live topic (`Source.live`): a trajectory claiming a version newer than the newest this learner
        # published is a lie. A replayed recording carries its own run's numbers, so they are not bounded.
        self.live = False
        self.last_invalid = ""  # the reason of the latest 'invalid', for the dead-letter record
        self.grouped, self.window = grouped, window
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.counts: Counter[str] = Counter()

    def key(self, t: Trajectory) -> str:
        # a member of a group rollout is (task, member), whatever the estimator
        grouped = self.grouped or t.group_size > 1
        return f"{t.group_id or t.task_id}/{t.traj_id}" if grouped else t.task_id

    def admit(self, t: Trajectory, version: int) -> str:
        """'ok', 'duplicate', 'invalid', 'greedy' or 'stale' (counted in `counts`)."""
        key = self.key(t)
        newest = self.lineage.newest if self.live else None
        if key in self.seen:
            reason = "duplicate"
        elif (why := invalid_reason(t, self.vocab_size, self.max_tokens, newest)) is not None:
            reason, self.last_invalid = "invalid", why
        elif t.temperature <= 0:
            reason = "greedy"
        elif staleness(t, version, self.lineage) > self.max_staleness:
            reason = "stale"
        else:
            reason = "ok"
        if reason != "duplicate":
            self.seen[key] = None
            while len(self.seen) > self.window:
                self.seen.popitem(last=False)
        self.counts[reason] += 1
        return reason

    def split_stale(self, trajs: list[Trajectory], version: int, group_key=None) -> tuple[list, list]:
        """(fresh, stale) at training time; with `group_key`, a group is stale if any member is."""
        if group_key is None:
            stale_ids = {id(t) for t in trajs if staleness(t, version, self.lineage) > self.max_staleness}
        else:
            bad = {group_key(t) for t in trajs if staleness(t, version, self.lineage) > self.max_staleness}
            stale_ids = {id(t) for t in trajs if group_key(t) in bad}
        fresh = [t for t in trajs if id(t) not in stale_ids]
        stale = [t for t in trajs if id(t) in stale_ids]
        self.counts["stale"] += len(stale)
        return fresh, stale

    def state(self) -> dict:
        return {"seen": list(self.seen), "counts": dict(self.counts), "lineage": self.lineage.anchors}

    def load_state(self, state: dict) -> None:
        self.seen = OrderedDict((k, None) for k in state.get("seen", []))
        self.counts = Counter(state.get("counts", {}))
        self.lineage = Lineage(state.get("lineage"))

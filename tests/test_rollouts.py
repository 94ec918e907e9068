"""Tasks in flight (`streamer.agent.rollouts`, `AgentSettings.concurrency`): shared batches, overlapping tool
calls, commits that never pass a task still in flight, versions recorded across a weight swap."""

from __future__ import annotations

import msgspec
import pytest
from kafka_fixtures import scenario_tasks

from learner.engines import Engine, Generation
from learner.models.tokenizer import EOS_ID, CharTokenizer
from streamer.agent.agent import build_agent
from streamer.agent.rollouts import Rollouts, rollout
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.sinks import KafkaTaskSink
from streamer.wire.schema import Trajectory, decode
from streamer.wire.settings import AgentSettings, TopicSettings
from streamer.wire.topics import Topics, partitions_by_topic


class ToolDemoEngine(Engine):
    """Plays each tool task's demonstration (call, then answer after the observation); records batch sizes."""

    def __init__(self, tasks) -> None:
        from simulator.families import get_family

        self.tok = CharTokenizer()
        self.demos = {t.prompt: get_family("tool").demonstrate(t) for t in tasks}
        self.batches: list[int] = []

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, stop=None, seed=None):
        self.batches.append(len(prompts))
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            demo = next(d for q, d in self.demos.items() if text.startswith(q))
            call, _, rest = demo.partition("</call>")
            ids = self.tok.encode(call + "</call>") if "<obs>" not in text else \
                self.tok.encode(rest.partition("</obs>")[2]) + [EOS_ID]
            out.append(Generation(ids, [-0.5] * len(ids), [-0.5] * len(ids), "stop", self.version,
                                  self.tok.decode(ids)))
        return out

    def load_state_dict(self, state_dict, version=None):
        self._bump(version)


def tool_tasks(n: int, latency_s: list[float]):
    tasks = [t for t in scenario_tasks(60) if t.family == "tool"][:n]
    return [msgspec.structs.replace(t, spec={**t.spec, "latency": {"kind": "const", "mean_s": s}})
            for t, s in zip(tasks, latency_s)]


def drain(r: Rollouts) -> list:
    out = []
    while len(r):
        out += r.advance(timeout=5.0)
    return out


def test_tasks_in_flight_share_batches_and_give_the_trajectories_of_one_at_a_time():
    tasks = tool_tasks(3, [0.0, 0.0, 0.0])
    s = AgentSettings(max_new_tokens=16, concurrency=3)
    engine = ToolDemoEngine(tasks)
    r = Rollouts(engine, CharTokenizer(), s)
    for t in tasks:
        r.start(t, key=t.task_id)
    together = {d.key: d.trajectories[0] for d in drain(r)}
    r.close()
    assert engine.batches[0] == 3  # the three first turns in one engine call
    alone = AgentSettings(max_new_tokens=16)
    for t in tasks:
        [one] = rollout(ToolDemoEngine(tasks), CharTokenizer(), t, alone)
        got = together[t.task_id]
        assert (got.tokens, got.loss_mask, got.logprobs, got.reward) == (one.tokens, one.loss_mask, one.logprobs, 1.0)


def test_a_slow_tool_call_holds_only_its_own_task():
    slow, fast1, fast2 = tool_tasks(3, [1.5, 0.0, 0.0])
    r = Rollouts(ToolDemoEngine([slow, fast1, fast2]), CharTokenizer(), AgentSettings(max_new_tokens=16, concurrency=3))
    for t in (slow, fast1, fast2):
        r.start(t, key=t.task_id)
    first = []
    while len(first) < 2:
        first += r.advance(timeout=5.0)
    assert {d.key for d in first} == {fast1.task_id, fast2.task_id} and len(r) == 1
    [last] = drain(r)
    r.close()
    assert last.key == slow.task_id and last.trajectories[0].env_seconds == pytest.approx(1.5)


def _agent_on(run: str, tasks, engine):
    """An agent with 3 tasks in flight over the one task partition of an in-memory bus holding `tasks`."""
    bus = MemoryBus()
    bus.create_topics(partitions_by_topic(run, TopicSettings(tasks_partitions=1)))
    sink = KafkaTaskSink(None, run, producer=bus.producer())
    for t in tasks:
        sink.write(t)
    s = AgentSettings(run=run, max_new_tokens=16, concurrency=3, idle_exit_s=0.01,
                      topics=TopicSettings(tasks_partitions=1))
    return bus, build_agent(s, bus, engine, CharTokenizer())


def test_commits_stop_at_the_oldest_task_in_flight():
    run = "c"
    tasks = tool_tasks(3, [1.5, 0.0, 0.0])  # offsets 0 (slow), 1, 2 of the one task partition
    bus, agent = _agent_on(run, tasks, ToolDemoEngine(tasks))
    while agent.stats.tasks < 2:
        agent.step()
    produced = [decode(v, Trajectory).task_id for part in bus.logs[Topics(run).trajectories] for _, v in part]
    assert sorted(produced) == sorted(t.task_id for t in tasks[1:])
    assert list(bus.committed[f"{run}.agents"].values()) == [0]  # offsets 1 and 2 wait for offset 0
    agent.run()
    assert list(bus.committed[f"{run}.agents"].values()) == [3]
    assert agent.status()["in_flight"] == 0


class FailingEngine(ToolDemoEngine):
    """Raises torch.OutOfMemoryError (a RuntimeError) on the first `failures` generate calls."""

    def __init__(self, tasks, failures: int) -> None:
        super().__init__(tasks)
        self.failures = failures

    def generate(self, *a, **k):
        import torch

        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return super().generate(*a, **k)


def test_an_engine_failure_is_retried_and_never_dead_letters_the_task(monkeypatch):
    """torch.OutOfMemoryError is a RuntimeError, which marked the task unrunnable: a broken engine dead-lettered
    and committed every task in turn (issue 14, finding 7)."""
    import streamer.agent.rollouts as ro

    monkeypatch.setattr(ro, "ENGINE_BACKOFF_S", 0.0)
    tasks = tool_tasks(3, [0.0, 0.0, 0.0])
    bus, agent = _agent_on("oom", tasks, FailingEngine(tasks, failures=ro.ENGINE_RETRIES - 1))
    agent.run()
    assert agent.stats.tasks == 3 and agent.stats.failed == 0 and not bus.logs.get(Topics("oom").dlq, [[]])[0]
    assert list(bus.committed["oom.agents"].values()) == [3]

    bus, agent = _agent_on("broken", tasks, FailingEngine(tasks, failures=10**6))
    with pytest.raises(ro.EngineError, match=r"generation failed 5 times in a row, last: OutOfMemoryError"):
        agent.run()
    assert agent.stats.failed == 0 and bus.committed.get("broken.agents", {}) == {}  # nothing committed


def test_a_weight_swap_between_turns_is_recorded_in_the_trajectory():
    [task] = tool_tasks(1, [0.0])
    engine = ToolDemoEngine([task])
    r = Rollouts(engine, CharTokenizer(), AgentSettings(max_new_tokens=16))
    r.start(task)
    assert r.advance(timeout=5.0) == []  # the call: its observation is in, the answer not yet
    engine.load_state_dict({}, version=1)
    [done] = drain(r)
    [tr] = done.trajectories
    assert (tr.policy_version, tr.policy_versions, tr.n_turns) == (0, [0, 1], 2)


def test_concurrency_below_one_is_refused():
    with pytest.raises(ValueError, match="concurrency"):
        AgentSettings(concurrency=0).validate()


def test_sao_up_passes_agent_settings_to_every_agent(tmp_path):
    from streamer.agent.agent import parse_args, settings_from_args
    from streamer.launch.up import parse_args as up_args
    from streamer.launch.up import roles
    from streamer.wire.config import write_yaml

    cfg = up_args(["--agents", "2", "--set", "agent.concurrency=8", "--sync", "--sync-batch", "32", "--seed", "3"])
    write_yaml(cfg, tmp_path / "config.yaml")
    agents = [r for r in roles(cfg, tmp_path / "config.yaml", tmp_path, "127.0.0.1:1") if r.name.startswith("agent")]
    assert len(agents) == 2
    seeds, ids = [], []
    for r in agents:  # each agent reads the agent section of the run's config.yaml
        s = settings_from_args(parse_args(r.argv[1:]))
        assert (s.concurrency, s.tasks_per_version, s.versions_ahead, s.run) == (8, 16, 0, cfg.launch.run)
        seeds.append(s.seed)
        ids.append(s.agent_id)
    assert seeds == [3001, 3002]
    # ids that outlive a restart: a restarted agent's policy consumer skips the letters its predecessor sent
    assert ids == ["agent-0", "agent-1"]

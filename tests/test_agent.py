"""The agent over the in-memory bus: rollouts, groups, multi-turn bookkeeping, commit-after-flush, offline mode."""

from __future__ import annotations

import json

import pytest
from kafka_fixtures import scenario_tasks

from learner.engines import Engine, Generation, make_engine
from learner.models.tokenizer import EOS_ID, CharTokenizer
from streamer.agent.agent import build_agent, main
from streamer.agent.rollouts import rollout
from streamer.transport.memory_bus import MemoryBus, MemoryProducer
from streamer.transport.sinks import KafkaTaskSink
from streamer.wire.schema import Task, Trajectory, decode
from streamer.wire.settings import AgentSettings
from streamer.wire.topics import Topics, partitions_by_topic


def _setup(tasks: list[Task], run: str = "a", **kw):
    bus = MemoryBus()
    bus.create_topics(partitions_by_topic(run))  # 4 task partitions
    sink = KafkaTaskSink(None, run, producer=bus.producer())
    for t in tasks:
        sink.write(t)
    s = AgentSettings(run=run, max_new_tokens=6, idle_exit_s=0.01, **kw)
    return bus, s


def _trajectories(bus: MemoryBus, run: str) -> list[Trajectory]:
    return [decode(v, Trajectory) for part in bus.logs[Topics(run).trajectories] for _, v in part]


def test_single_rollout_answers_each_task_once_and_commits_everything(tiny_policy_dir):
    tasks = scenario_tasks(12)
    bus, s = _setup(tasks)
    engine = make_engine("torch", tiny_policy_dir)
    stats = build_agent(s, bus, engine, engine.tokenizer).run()
    trajs = _trajectories(bus, "a")
    assert stats.tasks == 12 and sorted(t.task_id for t in trajs) == sorted(t.task_id for t in tasks)
    assert {t.family for t in trajs} == {"arith", "string", "format", "tool"}
    tok = CharTokenizer()
    by_id = {t.task_id: t for t in tasks}
    for tr in trajs:
        tr.validate()
        assert tr.tokens[: tr.prompt_len] == tok.encode(by_id[tr.task_id].prompt, bos=True)
        assert tr.loss_mask[: tr.prompt_len] == [0] * tr.prompt_len and sum(tr.loss_mask) >= 1
        assert all((lp == 0.0) if m == 0 else (lp < 0.0) for m, lp in zip(tr.loss_mask, tr.logprobs))
        assert tr.policy_version == 0 and tr.policy_versions == [0] and tr.group_size == 1
    committed = bus.committed["a.agents"]
    assert sum(committed.values()) == 12  # every partition committed up to its end
    assert all(committed[tp] == len(bus.logs["a.tasks"][tp.partition]) for tp in committed)


def test_group_rollout_shares_task_and_version(tiny_policy_dir):
    bus, s = _setup(scenario_tasks(3), group_size=4)
    engine = make_engine("torch", tiny_policy_dir)
    build_agent(s, bus, engine, engine.tokenizer).run()
    trajs = _trajectories(bus, "a")
    assert len(trajs) == 12 and len({t.traj_id for t in trajs}) == 12
    for task_id in {t.task_id for t in trajs}:
        group = [t for t in trajs if t.task_id == task_id]
        assert len(group) == 4 and {t.group_id for t in group} == {task_id} and {t.group_size for t in group} == {4}


class ScriptedEngine(Engine):
    """Plays a task's demonstration: the tool call first, the answer after the observation."""

    def __init__(self, demos: dict[str, str]) -> None:
        self.tok, self.demos = CharTokenizer(), demos

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, stop=None, seed=None):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            demo = next(d for q, d in self.demos.items() if text.startswith(q))
            call, _, rest = demo.partition("</call>")
            if "<obs>" not in text:
                ids = self.tok.encode(call + "</call>")
            else:
                ids = self.tok.encode(rest.partition("</obs>")[2]) + [EOS_ID]
            out.append(Generation(ids, [-0.5] * len(ids), [-0.5] * len(ids), "stop", self.version,
                                  self.tok.decode(ids)))
        return out

    def load_state_dict(self, state_dict, version=None):
        self._bump(version)


def test_multi_turn_tool_episode_masks_observations():
    from simulator.families import get_family

    task = next(t for t in scenario_tasks(20) if t.family == "tool")
    demo = get_family("tool").demonstrate(task)  # "<call>look(zir)</call><obs>35</obs>35"
    call, obs, answer = (demo.partition("</call>")[0] + "</call>",
                         "<obs>" + demo.split("<obs>")[1].split("</obs>")[0] + "</obs>", task.answer)
    s = AgentSettings(max_new_tokens=16, max_turns=4)
    [tr] = rollout(ScriptedEngine({task.prompt: demo}), CharTokenizer(), task, s)
    tok = CharTokenizer()
    prompt = tok.encode(task.prompt, bos=True)
    # prompt (not trained) + call (generated) + observation (environment) + answer and eos (generated)
    want = prompt + tok.encode(call) + tok.encode(obs) + tok.encode(answer) + [EOS_ID]
    assert tr.tokens == want
    assert tr.loss_mask == [0] * len(prompt) + [1] * len(tok.encode(call)) + [0] * len(tok.encode(obs)) \
        + [1] * (len(tok.encode(answer)) + 1)
    assert tr.logprobs == [-0.5 if m else 0.0 for m in tr.loss_mask]
    assert (tr.n_turns, tr.n_tool_calls, tr.success, tr.reward) == (2, 1, True, 1.0)
    assert tr.env_seconds == pytest.approx(0.002)  # the scenario's constant tool latency


class FailingFlushProducer(MemoryProducer):
    def flush(self, timeout=None):
        raise ConnectionError("broker gone")


def test_a_task_is_not_committed_when_its_trajectory_is_not_flushed(tiny_policy_dir):
    bus, s = _setup(scenario_tasks(1))
    engine = make_engine("torch", tiny_policy_dir)
    agent = build_agent(s, bus, engine, engine.tokenizer)
    agent.producer = FailingFlushProducer(bus)
    with pytest.raises(ConnectionError):
        agent.step()
    assert not bus.committed.get("a.agents")
    agent.tasks.close()
    again = build_agent(s, bus, engine, engine.tokenizer)  # the replacement agent gets the task again
    assert again.run().tasks == 1
    [(tp, n)] = [(tp, n) for tp, n in bus.committed["a.agents"].items() if n]
    assert n == 1 and bus.logs["a.tasks"][tp.partition]  # the one task, committed once answered


def test_offline_agent_answers_a_task_file(tmp_path, tiny_policy_dir):
    from simulator.sinks import JsonlSink

    tasks = scenario_tasks(5)
    sink = JsonlSink(tmp_path / "tasks.jsonl")
    for t in tasks:
        sink.write(t)
    sink.close()
    out = tmp_path / "traj.jsonl"
    assert main(["--tasks", str(tmp_path / "tasks.jsonl"), "--out", str(out), "--model", str(tiny_policy_dir),
                 "--set", "max_new_tokens=4", "--weights-dir", str(tmp_path / "w")]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["task_id"] for r in rows) == sorted(t.task_id for t in tasks)


def test_bad_settings_are_refused_with_the_field_name(capsys):
    assert main(["--set", "group_size=0"]) == 2
    assert "group_size" in capsys.readouterr().err


def test_sync_baseline_waits_for_a_new_version_after_its_share(tmp_path, tiny_policy_dir):
    from streamer.transport.weights import WeightStore, announce

    bus, s = _setup(scenario_tasks(6), tasks_per_version=2, weights_dir=str(tmp_path / "w"))
    engine = make_engine("torch", tiny_policy_dir)
    agent = build_agent(s, bus, engine, engine.tokenizer)
    s.poll_timeout_s = 0.0
    done = sum(agent.step() for _ in range(10))
    assert done == 2 and agent.status()["waiting_for_version"]  # its share of v0, then it waits
    store = WeightStore(tmp_path / "w")
    announce(bus.producer(), "a", store.publish(tiny_policy_dir, version=1, step=1))
    done = sum(agent.step() for _ in range(10))
    assert done == 2 and engine.version == 1
    trajs = sorted(_trajectories(bus, "a"), key=lambda t: t.started_at)
    assert [t.policy_version for t in trajs] == [0, 0, 1, 1]


def test_versions_ahead_bounds_the_tasks_started_before_the_learner_catches_up(tmp_path, tiny_policy_dir):
    from streamer.transport.weights import WeightStore, announce

    bus, s = _setup(scenario_tasks(9), tasks_per_version=2, versions_ahead=1, concurrency=3,
                    weights_dir=str(tmp_path / "w"))
    engine = make_engine("torch", tiny_policy_dir)
    agent = build_agent(s, bus, engine, engine.tokenizer)
    s.poll_timeout_s = 0.05

    def until_blocked() -> int:
        done = 0
        for _ in range(400):
            done += agent.step()
            if agent.status()["waiting_for_version"] and not len(agent.rollouts):
                break
        return done + sum(agent.step() for _ in range(5))  # and nothing more while it waits

    assert until_blocked() == 4  # (this version + 1 ahead) x 2 tasks
    announce(bus.producer(), "a", WeightStore(tmp_path / "w").publish(tiny_policy_dir, version=1, step=1))
    assert until_blocked() == 2 and engine.version == 1  # one more version: two more tasks


def test_a_restarted_agent_continues_its_admission_instead_of_starting_over(tmp_path, tiny_policy_dir):
    """Started again at version 5 with its budget counted from there, an agent took (5 + 2) x 64 tasks the learner
    had not asked for, which went stale (bench/chaos.py: 428 stale drops after 2 agent kills)."""
    import json

    status = tmp_path / "agent-0.json"
    status.write_text(json.dumps({"first_version": 0, "started": 11, "in_flight": 3, "version": 5}))
    bus, s = _setup(scenario_tasks(20), tasks_per_version=2, versions_ahead=1, weights_dir=str(tmp_path / "w"))
    engine = make_engine("torch", tiny_policy_dir)
    engine._bump(5)  # the newest version, loaded at start
    agent = build_agent(s, bus, engine, engine.tokenizer, str(status))
    # v5 allows (5 - 0 + 1 + 1) x 2 = 14 tasks since v0; 11 were started, 3 of them were in flight (redelivered)
    assert agent._admissible() == 14 - 8


def test_a_task_the_environment_cannot_run_goes_to_the_dlq_and_the_agent_goes_on(tiny_policy_dir):
    from streamer.wire.schema import DeadLetter

    good = scenario_tasks(2)
    poison = Task(task_id="poison", family="nope", concept="x", prompt="1+1=", answer="2")
    bus, s = _setup([good[0], poison, good[1]])
    engine = make_engine("torch", tiny_policy_dir)
    stats = build_agent(s, bus, engine, engine.tokenizer).run()
    assert (stats.tasks, stats.failed) == (2, 1)
    assert sorted(t.task_id for t in _trajectories(bus, "a")) == sorted(t.task_id for t in good)
    [letter] = [decode(v, DeadLetter) for part in bus.logs["a.dlq"] for _, v in part]
    assert letter.reason.startswith("rollout failed") and "nope" in letter.reason
    assert decode(letter.value, Task) == poison
    assert sum(bus.committed["a.agents"].values()) == 3  # the poison task is committed too: no agent retries it

"""The resource plan of `sao up` and learner-paced admission (streamer/launch/resources.py, streamer/launch/up.py)."""

from pathlib import Path

import pytest

from streamer.launch.resources import AGENT_NICE, SIDE_NICE, check_pacing, paced_admission, plan_resources, thread_env
from streamer.launch.up import parse_args, roles
from streamer.wire.config import ConfigError


@pytest.mark.parametrize("cores, learner, agents, agent_threads, ev", [
    (1, 1, 1, 1, False),  # one core: everything shares it, the learner still gets its thread
    (2, 1, 1, 1, False),  # the target machine: learner one core, one agent the other, no evaluator
    (4, 2, 2, 1, True),
    (8, 4, 4, 1, True),
    (16, 4, 4, 3, True),  # learner capped at 4 threads, agents capped at 4, the rest as agent threads
])
def test_plan_gives_the_learner_its_cores_first(cores, learner, agents, agent_threads, ev):
    p = plan_resources(cores)
    assert (p.learner_threads, p.agents, p.agent_threads, p.eval) == (learner, agents, agent_threads, ev)
    assert p.learner_threads + p.agents * p.agent_threads <= max(cores, 2)


def test_plan_keeps_explicit_agents_and_eval():
    p = plan_resources(2, agents=3, eval=True)
    assert (p.agents, p.agent_threads, p.eval) == (3, 1, True)
    assert "2 cores" in p.describe() and "evaluator on" in p.describe()
    with pytest.raises(ConfigError, match="cores"):
        plan_resources(0)


def test_paced_admission_one_batch_per_version_within_the_staleness_bound():
    a = paced_admission(staleness=2, batch_trajectories=64, agents=3)
    assert (a.tasks_per_version, a.versions_ahead, a.concurrency) == (22, 1, 22)  # ceil(64 / 3)
    check_pacing(a, agents=3, group_size=1, batch_trajectories=64, staleness=2)
    g = paced_admission(staleness=4, batch_trajectories=64, agents=2, group_size=8)
    assert (g.tasks_per_version, g.versions_ahead) == (4, 3)  # 2 agents x 4 tasks x 8 members = 64
    s = paced_admission(staleness=0, batch_trajectories=64, agents=2)
    assert (s.tasks_per_version, s.versions_ahead) == (32, 0)  # synchronous: a share, then wait


def test_pacing_that_would_deadlock_or_go_stale_is_refused():
    a = paced_admission(2, 64, 2)
    with pytest.raises(ConfigError, match="wait forever"):
        check_pacing(a, agents=1, group_size=1, batch_trajectories=64, staleness=2)
    with pytest.raises(ConfigError, match="versions_ahead"):
        check_pacing(paced_admission(5, 64, 1), agents=1, group_size=1, batch_trajectories=64, staleness=2)
    with pytest.raises(ConfigError, match="staleness"):
        paced_admission(-1, 64, 1)


def test_up_passes_one_staleness_bound_to_learner_and_agents():
    cfg = parse_args(["--run", "r", "--cores", "2", "--batch", "32", "--staleness", "3"])
    by_name = {r.name: r for r in roles(cfg, Path("runs/r/config.yaml"), Path("runs/r"), "127.0.0.1:1")}
    assert set(by_name) == {"metrics", "learner", "agent-0", "dashboard", "simulator"}  # no evaluator on 2 cores
    assert all(by_name[n].argv[1:3] == ["--config", "runs/r/config.yaml"] for n in ("metrics", "learner", "agent-0"))
    lb, agent = cfg.learner.batch, cfg.agent  # what each role reads from its section of config.yaml
    assert (lb.max_staleness, lb.max_trajectories, lb.tokens, cfg.learner.threads) == (3, 32, 32 * 1024, 1)
    assert (agent.tasks_per_version, agent.versions_ahead, agent.concurrency, agent.threads) == (32, 2, 32, 1)
    assert by_name["learner"].nice == 0 and by_name["agent-0"].nice == AGENT_NICE
    assert by_name["dashboard"].nice == SIDE_NICE and by_name["learner"].env == thread_env(1)
    sim = by_name["simulator"].argv
    assert sim[sim.index("--max-lag") + 1] == str(32 + 32)  # in flight (32) plus one batch (32)


def test_up_refuses_overrides_that_would_break_the_pacing(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--set", "learner.batch.max_staleness=8"])
    assert "--staleness" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--set", "agent.versions_ahead=3"])
    assert "agent.versions_ahead" in capsys.readouterr().err


def test_progress_shows_the_newest_concept_of_each_family(tmp_path):
    from streamer.runs.artifacts import RunWriter
    from streamer.runs.tap import Tap
    from streamer.wire.schema import Trajectory

    def traj(i, family, concept, reward):
        return Trajectory(traj_id=f"t{i}", task_id=f"t{i}", family=family, concept=concept, phase=0, tokens=[1, 2],
                          loss_mask=[0, 1], logprobs=[0.0, -0.1], reward=reward, prompt_len=1)

    tap = Tap(consumer=None, writer=RunWriter(tmp_path))
    for i, (fam, con, r) in enumerate([("format", "brackets", 1.0), ("format", "parens", 0.0),
                                       ("format", "parens", 1.0), ("string", "sort", 0.0)]):
        tap.handle(traj(i, fam, con, r))
    assert tap.concept_means() == {"format/parens": 0.5, "string/sort": 0.0}  # brackets is no longer newest
    tap.writer.close()

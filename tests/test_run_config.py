"""The run configuration: one tree, one override syntax, derived keys set in one place, each role reads its section."""

from __future__ import annotations

import pytest

from learner.config import LearnerConfig
from streamer.agent.agent import parse_args as agent_args
from streamer.agent.agent import settings_from_args
from streamer.launch.run_config import TOKENS_PER_TRAJECTORY, load_run_config
from streamer.launch.up import Stop, finished, parse_args
from streamer.metrics.app import MetricsSettings
from streamer.wire.config import ConfigError, load_config, write_yaml


def test_each_role_reads_its_section_of_the_written_run_file(tmp_path):
    cfg = parse_args(["--run", "r1", "--runs-dir", str(tmp_path), "--cores", "2", "--batch", "16",
                      "--set", "learner.optim.lr=3e-5", "--set", "agent.max_new_tokens=20",
                      "--set", "metrics.window_s=2.5"])
    path = tmp_path / "config.yaml"
    write_yaml(cfg, path)
    learner = load_config(LearnerConfig, path, section="learner")
    assert learner == cfg.learner and learner.optim.lr == 3e-5
    assert (learner.batch.max_trajectories, learner.batch.tokens) == (16, 16 * TOKENS_PER_TRAJECTORY)
    assert learner.io.run == "r1" and learner.checkpoint.dir == str(tmp_path / "r1" / "checkpoints")
    agent = settings_from_args(agent_args(["--config", str(path)]))
    assert (agent.max_new_tokens, agent.tasks_per_version, agent.run) == (20, 16, "r1")
    assert load_config(MetricsSettings, path, section="metrics").window_s == 2.5
    # a role's own --set still applies on top of the run file
    assert settings_from_args(agent_args(["--config", str(path), "--set", "max_new_tokens=9"])).max_new_tokens == 9


def test_defaults_then_file_then_set_then_flags(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("launch:\n  batch: 16\n  staleness: 3\nlearner:\n  optim:\n    lr: 0.001\n")
    assert load_run_config(path).launch.batch == 16
    assert load_run_config(path, ["launch.batch=24"]).launch.batch == 24
    cfg = load_run_config(path, ["launch.batch=24"], {"batch": 32})
    assert (cfg.launch.batch, cfg.learner.batch.max_trajectories, cfg.learner.batch.max_staleness) == (32, 32, 3)
    assert cfg.learner.optim.lr == 0.001


def test_derived_keys_and_bad_choices_are_refused_with_the_field_named(capsys):
    with pytest.raises(ConfigError, match="learner.batch.tokens: sao up derives it"):
        load_run_config(None, ["learner.batch.tokens=100"])
    with pytest.raises(ConfigError, match="agent.tasks_per_version"):
        load_run_config(None, ["agent.tasks_per_version=3"])
    with pytest.raises(ConfigError, match="agent.engine: 'tensorrt' is not one of torch, hf, vllm"):
        load_run_config(None, ["agent.engine=tensorrt"])
    with pytest.raises(ConfigError, match="unknown field 'lrr'"):
        load_run_config(None, ["learner.optim.lrr=1"])
    with pytest.raises(SystemExit):
        parse_args(["--set", "launch.staleness=-1"])
    assert "staleness -1" in capsys.readouterr().err


def test_agent_concurrency_follows_admission_unless_given():
    assert load_run_config(None, [], {"batch": 8, "cores": 2}).agent.concurrency == 8
    assert load_run_config(None, ["agent.concurrency=3"], {"batch": 8, "cores": 2}).agent.concurrency == 3


def test_the_run_kafka_reaches_every_role_section_unless_set_there():
    cfg = load_run_config(None, ["agent.client.bootstrap=b:9"], {"bootstrap": "kafka:9092"})
    sections = (cfg.learner.io.bootstrap, cfg.metrics.bootstrap, cfg.agent.client.bootstrap)
    assert sections == ("kafka:9092", "kafka:9092", "b:9")
    assert load_run_config(None).learner.io.bootstrap == ""  # the embedded broker: its address is given at start


def test_a_stop_request_ends_the_run_with_its_reason():
    stop = Stop()
    up = load_run_config().launch
    assert not stop.requested
    stop.request("token budget 400 reached")
    stop.request("a later reason")  # the first one stands
    assert finished(up, None, None, None, 0.0, [0.0], stop) == "stopped by request: token budget 400 reached"

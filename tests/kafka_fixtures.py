"""Fixtures for integration tests against the real embedded broker (Tansu), one per test session.

Tests that use them are marked `@pytest.mark.kafka`. Each test gets its own run name, so its
topics (`<run>.tasks`, ...) never mix with another test's on the shared broker.
"""

from __future__ import annotations

import itertools
import os

import pytest

from streamer.transport.broker import EmbeddedBroker
from streamer.transport.kafka_bus import KafkaBus
from streamer.wire.settings import BrokerSettings, ClientSettings

_runs = itertools.count()


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """A Tansu broker on a free loopback port ($SAO_TEST_BOOTSTRAP: use that broker instead)."""
    external = os.environ.get("SAO_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    log_path = tmp_path_factory.mktemp("broker") / "tansu.log"
    broker = EmbeddedBroker(BrokerSettings(port=0, log_path=str(log_path))).start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def bootstrap(kafka_broker) -> str:
    return kafka_broker


@pytest.fixture
def kafka_bus(bootstrap) -> KafkaBus:
    return KafkaBus(bootstrap, ClientSettings(client_id="sao-test"))


@pytest.fixture
def kafka_run(request) -> str:
    """A run name unique within the session: 't<n>-<test name>' (topic-safe)."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"t{next(_runs)}-{os.getpid()}-{name}".strip("-")


TINY = dict(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=2, experts_per_token=1,
            expert_width=32, max_positions=256)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory):
    """A saved, randomly initialised one-layer policy (~20k parameters) with the char tokenizer."""
    from learner.models import CharTokenizer, ModelConfig, build_policy, save_policy

    path = tmp_path_factory.mktemp("tiny_policy")
    save_policy(build_policy(ModelConfig(**TINY), seed=0), path, CharTokenizer())
    return path


def scenario_tasks(n: int, seed: int = 1, scenario: str = "default"):
    """The first n tasks of a simulator scenario (all four families)."""
    from simulator.generator import generate
    from simulator.scenario import load_scenario
    from streamer.wire.schema import Task

    out = []
    for msg in generate(load_scenario(scenario), seed=seed):
        if isinstance(msg, Task):
            out.append(msg)
            if len(out) == n:
                return out
    return out


def train_from_topic(bus: KafkaBus, topic: str, ckpt, n_expected: int, seed: int = 0) -> list[str]:
    """A real learner over `topic` (resuming from `ckpt` if it can) until it has trained `n_expected` trajectories;
    the task ids it trained, in order."""
    from learner.config import LearnerConfig
    from learner.train import build_models
    from learner.trainer.loop import Trainer
    from learner.trainer.source import BusSource
    from learner.trainer.synthetic import TINY_OVERRIDES
    from streamer.wire.config import load_config
    from streamer.wire.schema import Trajectory

    cfg = load_config(LearnerConfig, None, TINY_OVERRIDES + [
        f"checkpoint.dir={ckpt}", "batch.max_trajectories=4", "batch.tokens=100000", f"seed={seed}"])
    seen: list[str] = []
    source = BusSource(bus.consumer({topic: Trajectory}, group_id=None))

    def sink(e) -> None:
        seen.extend(e.task_ids)
        trainer.stop = len(seen) >= n_expected

    trainer = Trainer(cfg, build_models(cfg), source, None, [sink])
    trainer.resume()
    try:
        trainer.run()
    finally:
        source.close()
    return seen

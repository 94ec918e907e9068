"""Shared fixtures. A session in which no test ran (all skipped, none collected) fails."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SAO_TEST_THREADS", "2")))


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or session.config.option.collectonly:
        return
    ran = len(reporter.stats.get("passed", [])) + len(reporter.stats.get("failed", []))
    if ran == 0 and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED

# Embedded-broker fixtures for `@pytest.mark.kafka` tests (owned by the streaming plane).
from kafka_fixtures import bootstrap, kafka_broker, kafka_bus, kafka_run, tiny_policy_dir  # noqa: E402,F401

"""The running dashboard in headless Chromium, against a run being written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dashboard import browser, demo

pytestmark = pytest.mark.browser

SHOTS = Path(__file__).resolve().parents[1] / "runs" / "browser"


@pytest.fixture
def live_run(tmp_path):
    """A run whose parts keep arriving (8 parts, one every 0.7 s) while the test looks at it."""
    runs = tmp_path / "runs"
    writer = threading.Thread(target=demo.write, args=(runs / "live-demo", 6000),
                              kwargs={"parts": 8, "delay_s": 0.7, "close": False}, daemon=True)
    writer.start()
    yield runs
    writer.join(timeout=60)


def test_reward_chart_and_drift_markers_in_chromium(live_run, tmp_path):
    if None in browser.binaries():
        pytest.fail("chromium/chromedriver missing: apt-get install -y chromium chromium-driver")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with browser.serve(live_run, refresh=1.0, log_path=tmp_path / "streamlit.log") as url, \
            browser.chromium(tmp_path / "chrome-profile") as driver:
        driver.get(url)
        # first paint shows placeholders: wait for the reward lines themselves
        lines = browser.wait_css(driver, browser.REWARD_LINES, timeout=90)
        assert lines, "reward chart has no lines"
        # the run is still being written: the drift events arrive with later parts and live refresh shows them
        rules = browser.wait_css(driver, browser.DRIFT_RULES, timeout=90, min_count=2)
        labels = browser.wait_css(driver, browser.DRIFT_LABELS, timeout=30, min_count=2)
        assert len(rules) >= 2
        assert {"phase1", "phase2"} <= {el.text for el in labels}
        assert "Online reward per family" in driver.page_source
        assert browser.wait_css(driver, browser.CANVAS_CHARTS, timeout=30), "no canvas chart drew"
        driver.save_screenshot(str(SHOTS / "dashboard_live.png"))
    assert (SHOTS / "dashboard_live.png").stat().st_size > 10_000

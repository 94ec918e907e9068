"""Helpers to drive the dashboard in headless Chromium (the browser test and bench/dashboard.py).

    with serve(runs_dir) as url, chromium(tmp_dir) as driver:
        driver.get(url); wait_reward_chart(driver, 60)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,2400"]
# SVG classes Vega gives the marks of the reward chart (a mark named N gets the class "N_marks")
REWARD_LINES = "svg g.reward_lines_marks path"
DRIFT_RULES = "svg g.drift_rules_marks line, svg g.drift_rules_marks path"
DRIFT_LABELS = "svg g.drift_labels_marks text"
# the other charts draw on canvas (what a screenshot tool that waits for a drawn Vega chart looks for)
CANVAS_CHARTS = '[data-testid="stVegaLiteChart"] canvas'


def binaries() -> tuple[str | None, str | None]:
    """(chromium, chromedriver) paths, None where missing."""
    return (shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(runs: str | Path, refresh: float = 1.0, port: int | None = None, log_path: Path | None = None,
          timeout: float = 90.0) -> Iterator[str]:
    """Run `sao dashboard` on a free localhost port; yields its URL once the server answers."""
    port = port or free_port()
    cmd = [sys.executable, "-c", "import sys; from dashboard.launch import main; sys.exit(main(sys.argv[1:]))",
           "--port", str(port), "--runs", str(runs), "--refresh", str(refresh)]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    root = Path(__file__).resolve().parents[1]
    # own process group: stopping it also stops the streamlit child the launcher spawned
    proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dashboard server exited with {proc.returncode} (log: {log_path})")
            try:
                urllib.request.urlopen(url + "_stcore/health", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"dashboard server not up on {url} after {timeout:g} s") from None
                time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        if log_path:
            log.close()


@contextlib.contextmanager
def chromium(user_data_dir: str | Path) -> Iterator["object"]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_path = binaries()
    if not browser or not driver_path:
        raise RuntimeError("chromium and chromedriver are needed (Debian: apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={user_data_dir}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


def wait_css(driver, css: str, timeout: float, min_count: int = 1) -> list:
    """Wait until the page holds at least `min_count` elements matching `css`; returns them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: len(d.find_elements(By.CSS_SELECTOR, css)) >= min_count)
    return driver.find_elements(By.CSS_SELECTOR, css)

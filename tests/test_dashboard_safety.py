"""An untrusted dashboard visitor (issue 50 item 5): runs outside the root are refused and never opened (watched with
inotify), the server connects only to the operator's broker unless --allow-any-broker, live readers stay <= --max-live.
And the tap's dead letters are told apart from the learner's (issue 50 item 6)."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_dashboard import APP, write_run

from dashboard import access, browser, live
from dashboard.live import LiveTap, LiveTaps, close_all, kafka_consumer_factory, wait_for

IN_ACCESS, IN_OPEN = 0x1, 0x20


class OpenWatch:
    """inotify on a directory tree: every open or read of a file (or listing of a directory) under it, by any process
    (pyarrow's C++ reads included)."""

    def __init__(self, top: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.paths = {}
        for d, _, _ in os.walk(top):
            wd = self.libc.inotify_add_watch(self.fd, str(d).encode(), IN_OPEN | IN_ACCESS)
            assert wd >= 0, os.strerror(ctypes.get_errno())
            self.paths[wd] = d
        self.events()  # the walk's own listings

    def events(self) -> list[str]:
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                wd, _, _, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode()
                out.append(os.path.join(self.paths[wd], name))
                i += 16 + n

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def tree(tmp_path):
    """runs/r1 (a run), secret/s1 (a run outside the root), runs/link -> secret/s1."""
    root = tmp_path / "runs"
    write_run(root, "r1")
    write_run(tmp_path / "secret", "s1")
    (root / "link").symlink_to(tmp_path / "secret" / "s1", target_is_directory=True)
    return root, tmp_path / "secret" / "s1"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    close_all()
    yield
    close_all()


def app(root: Path, *options: str, query: list[str] = (), **state) -> AppTest:
    sys.argv = [APP, "--runs", str(root), *options]
    at = AppTest.from_file(APP, default_timeout=60)
    if query:
        at.query_params["run"] = list(query)
    at.session_state["auto_refresh"] = False
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    assert not at.exception, at.exception
    return at


def test_run_names_outside_the_root_are_refused(tree):
    root, secret = tree
    assert access.run_dir(root, "r1") == root.resolve() / "r1"
    for name, why in [("../secret/s1", "a path, not a run name"), ("..", "a path, not a run name"),
                      ("r1/../../secret/s1", "a path, not a run name"), (str(secret), "an absolute path"),
                      ("link", f"a symlink to {secret}")]:
        with pytest.raises(access.Refused) as e:
            access.run_dir(root, name)
        assert why in str(e.value) and str(root.resolve()) in str(e.value), e.value
    assert access.list_runs(root) == ["r1"]  # the symlink out is not offered


def test_app_refuses_outside_runs_and_opens_no_file_of_them(tree):
    root, secret = tree
    watch = OpenWatch(secret)
    try:
        at = app(root, query=["../secret/s1", str(secret), "link", "r1"])
        at.run()
        assert watch.events() == []  # nothing under secret/ opened, read or listed
        warnings = [w.value for w in at.sidebar.warning]
        assert len(warnings) == 3 and all("refused" in w for w in warnings), warnings
        assert at.session_state["runs"] == ["r1"]
        assert [m.value for m in at.markdown if m.value.startswith("**")] == ["**r1** (finished)"]
        (secret / "config.json").read_bytes()
        assert watch.events(), "the watch sees a read"  # so the empty list above means what it says
    finally:
        watch.close()


class Listener:
    """A TCP server on a free localhost port that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def live_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("live-") and t.is_alive()}


def test_visitor_cannot_choose_the_broker_without_the_flag(tree):
    root, _ = tree
    theirs, ours = Listener(), Listener()
    try:
        # what a visitor would set, as if it reached the session; the operator's broker is `ours`
        at = app(root, "--bootstrap", ours.address, "--run", "x", bootstrap=theirs.address, live_run="y")
        assert not [t for t in at.text_input if t.key in ("bootstrap", "live_run")]  # no field to type them in
        assert wait_for(lambda: ours.accepted >= 1, 20)  # the configured broker is tailed...
        at.run()
        time.sleep(1.0)
        assert theirs.accepted == 0  # ...and never the visitor's
        assert {t.name for t in live_threads()} == {"live-x"}

        at = app(root, "--allow-any-broker")  # the operator opted in: now the visitor's choice is used
        at.text_input(key="bootstrap").input(theirs.address)
        at.text_input(key="live_run").input("y").run()
        assert wait_for(lambda: theirs.accepted >= 1, 20)
        at.text_input(key="bootstrap").input(",".join([theirs.address] * 9)).run()
        assert any("give 1 to 8 host:port servers" in e.value for e in at.error)
    finally:
        theirs.close()
        ours.close()


def closed_port() -> str:
    return f"127.0.0.1:{browser.free_port()}"  # nothing listens: connections are refused at once


def test_live_readers_are_bounded_and_the_evicted_ones_stopped():
    before = live_threads()  # another test's tap still ending (a client bootstrapping), if any
    taps = LiveTaps(2, consumer_factory=kafka_consumer_factory, retry_s=0.2)
    made: list[LiveTap] = []
    try:
        for i in range(6):  # M = 6 distinct (broker, run) pairs, N = 2
            made.append(taps.get(closed_port(), f"r{i}"))
            assert len(taps) <= 2 and len(taps.threads()) <= 2 and len(live_threads() - before) <= 2
        assert [t.thread.is_alive() for t in made] == [False] * 4 + [True] * 2
        a, b = made[4], made[5]
        assert taps.get(a.bootstrap, a.run) is a  # a hit: no new thread, and `a` becomes the most recent
        taps.get(closed_port(), "r6")
        assert not b.thread.is_alive() and a.thread.is_alive()  # the least recently used went
    finally:
        taps.close()
    assert live_threads() - before == set()


def test_a_reader_stuck_on_a_silent_broker_keeps_its_slot():
    silent = Listener()  # accepts, never answers: the Kafka client waits for its bootstrap
    taps = LiveTaps(1, join_s=0.2)
    try:
        stuck = taps.get(silent.address, "r0")
        assert wait_for(lambda: silent.accepted >= 1, 20)
        with pytest.raises(live.ReadersBusy):  # evicted, still bootstrapping: no second thread is started
            taps.get(closed_port(), "r1")
        assert len(taps.threads()) == 1 and stuck.thread.is_alive()
        assert wait_for(lambda: not stuck.thread.is_alive(), 30)  # the bounded bootstrap gives up
        assert taps.get(closed_port(), "r1").thread.is_alive()
    finally:
        taps.close()
        silent.close()


def test_app_holds_at_most_max_live_readers(tree):
    root, _ = tree
    before = live_threads()
    at = app(root, "--allow-any-broker", "--max-live", "2")
    at.text_input(key="live_run").input("y").run()
    for _ in range(5):
        at.text_input(key="bootstrap").input(closed_port()).run()
        assert len(live.shared_taps(2)) <= 2 and len(live_threads() - before) <= 2
    assert len(live_threads() - before) == 2


@pytest.mark.kafka
def test_tap_and_learner_dead_letters_carry_different_consumer_names(kafka_bus, bootstrap, kafka_run, tmp_path):
    from learner.config import IOConfig, LearnerConfig
    from learner.train import build_source
    from streamer.runs.tap import TAP_CONSUMER, close_tap, open_tap
    from streamer.transport.kafka_bus import read_topic
    from streamer.wire.schema import DeadLetter, decode
    from streamer.wire.settings import ClientSettings
    from streamer.wire.topics import Topics, partitions_by_topic

    t = Topics(kafka_run)
    kafka_bus.create_topics(partitions_by_topic(kafka_run))
    p = kafka_bus.producer()
    offset = p.send_raw(t.trajectories, b"not a trajectory").get(timeout=30).offset
    p.flush()
    tap = open_tap(bootstrap, kafka_run, str(tmp_path / "run"))
    learner = build_source(LearnerConfig(io=IOConfig(run=kafka_run, bootstrap=bootstrap)))
    try:
        for consumer in (tap.consumer, learner.consumer):
            assert wait_for(lambda c=consumer: c.poll(max_records=100, timeout=0.5) == [] and c.dead_letters, 60)
            consumer.dlq_producer.flush()
    finally:
        close_tap(tap, summary=False)
        learner.consumer.close()
    letters = [decode(v, DeadLetter) for _, _, v in read_topic(bootstrap, ClientSettings(), t.dlq)]
    names = sorted(x.consumer for x in letters if (x.topic, x.partition, x.offset) == (t.trajectories, 0, offset))
    assert len(names) == 2 and len(set(names)) == 2 and TAP_CONSUMER in names, names


@pytest.mark.browser
def test_served_dashboard_refuses_outside_runs_in_chromium(tree, tmp_path):
    """The real server (`sao dashboard`, its own process) in headless Chromium, visited at ?run=../secret/s1."""
    root, secret = tree
    watch = OpenWatch(secret)
    try:
        with browser.serve(root, log_path=tmp_path / "streamlit.log") as url, \
                browser.chromium(tmp_path / "chrome-profile") as driver:
            driver.get(url + "?run=../secret/s1&run=link")
            assert wait_for(lambda: driver.page_source.count("refused") >= 2, 90), driver.page_source[-2000:]
            assert wait_for(lambda: "<strong>r1</strong>" in driver.page_source, 30)  # the run inside is shown
        assert watch.events() == []
    finally:
        watch.close()

"""Weights with no shared filesystem (issue 46 item 1): the learner's weight server and the agents' HTTP pull.

Real HTTP on localhost, real safetensors, a real torch engine: nothing shipped is mocked. The follower is the one
the directory store uses (`PolicyFollower`), over `HttpWeightSource`.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
import torch

from learner.config import LearnerConfig
from learner.engines import make_engine
from learner.models import load_policy
from learner.trainer.publish import DirectoryPublisher
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.weight_client import HttpWeightSource, fetch_model
from streamer.transport.weight_server import WeightServer
from streamer.transport.weights import MANIFEST_FILE, Announcer, CheckpointError, Manifest, PolicyFollower, announce
from streamer.wire.config import ConfigError
from streamer.wire.schema import PolicyVersion
from streamer.wire.settings import AgentSettings
from streamer.wire.topics import Topics

CHUNK = 16 * 1024  # the tiny test policy (~80 KB) spans several chunks


@pytest.fixture
def served(tmp_path):
    """A weight server on a free loopback port over an empty store: (server, its URL, the store's path)."""
    store = tmp_path / "store"
    server = WeightServer(store, "127.0.0.1:0").start()
    yield server, f"http://{server.address}", store
    server.close()


def _model(model_dir, scale: float):
    model = load_policy(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale)
    return model


def _follower(bus: MemoryBus, run: str, url: str) -> PolicyFollower:
    return PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), HttpWeightSource(url))


def _get(address: str, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(address, timeout=10)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


_writes: list[str] | None = None  # files opened for writing while set (the audit hook below records them)


def _audit(event: str, args: tuple) -> None:
    if _writes is not None and event == "open" and isinstance(args[0], str):
        mode, flags = args[1], args[2]
        if (mode and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & 0o3):
            _writes.append(args[0])


sys.addaudithook(_audit)


def test_a_published_version_is_pulled_into_the_engine_bit_for_bit_without_a_file(served, tiny_policy_dir):
    global _writes
    server, url, store = served
    bus, run = MemoryBus(), "pull"
    publisher = DirectoryPublisher(store, Announcer(bus.producer(), run), chunk_bytes=CHUNK, base_uri=url)
    follower, engine = _follower(bus, run, url), make_engine("torch", tiny_policy_dir)
    model = _model(tiny_policy_dir, 0.01)
    pv = publisher.publish(model, version=1, step=10)
    assert pv.uri == f"{url}/v000001"
    manifest = msgspec.json.decode((store / "v000001" / MANIFEST_FILE).read_bytes(), type=Manifest)
    weights = manifest.file("model.safetensors")
    assert weights.sha256 == pv.sha256 and len(weights.chunks) > 2 and manifest.chunk_bytes == CHUNK
    assert {f.name for f in manifest.files} >= {"model.safetensors", "config.json", "sao_tokenizer.json"}
    _writes = []
    try:
        assert follower.maybe_swap(engine) and engine.version == 1
        written, _writes = _writes, None
    finally:
        _writes = None
    assert written == [], f"the pull wrote files: {written}"
    loaded = engine.model.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[name], t), name


def test_a_corrupted_chunk_is_refused_naming_the_version_and_the_chunk(served, tiny_policy_dir):
    server, url, store = served
    bus, run = MemoryBus(), "bad"
    publisher = DirectoryPublisher(store, Announcer(bus.producer(), run), chunk_bytes=CHUNK, base_uri=url)
    follower, engine = _follower(bus, run, url), make_engine("torch", tiny_policy_dir)
    file = store / "v000001" / "model.safetensors"
    publisher.store.publish(_model(tiny_policy_dir, 0.01).state_dict(), 1, 1)  # written, not announced yet
    data = bytearray(file.read_bytes())
    data[2 * CHUNK + 5] ^= 0xFF  # altered after its manifest was written
    file.write_bytes(bytes(data))
    announce(bus.producer(), "bad", publisher.store.latest())
    assert not follower.maybe_swap(engine) and engine.version == 0
    assert "policy v1: chunk 2 of model.safetensors" in follower.refused[1] and "refused" in follower.refused[1]
    assert 1 not in follower.failed  # not transient: never fetched again
    assert follower.poll() is None


def test_a_forged_announcement_is_fetched_from_the_configured_server_only(served, tiny_policy_dir):
    server, url, store = served
    asked: list[str] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            asked.append(self.path)
            self.send_response(500)
            self.end_headers()

    elsewhere = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    try:
        bus, run = MemoryBus(), "forged"
        follower, engine = _follower(bus, run, url), make_engine("torch", tiny_policy_dir)
        pv = DirectoryPublisher(store, chunk_bytes=CHUNK).publish(_model(tiny_policy_dir, 0.02), 1, 1)
        other = f"http://127.0.0.1:{elsewhere.server_address[1]}"
        announce(bus.producer(), run, msgspec.structs.replace(pv, uri=f"{other}/v000001"))
        assert follower.maybe_swap(engine) and engine.version == 1  # from the configured server
        forged = PolicyVersion(version=2, uri=f"{other}/../../etc/passwd", sha256="ab" * 32, step=2)
        announce(bus.producer(), run, forged)
        assert not follower.maybe_swap(engine) and "does not end in a version directory" in follower.refused[2]
        assert asked == []
    finally:
        elsewhere.shutdown()
        elsewhere.server_close()


def test_only_version_files_are_served(served, tiny_policy_dir):
    server, url, store = served
    addr = server.address
    assert _get(addr, "/latest")[0] == 404  # nothing published yet
    pv = DirectoryPublisher(store, chunk_bytes=CHUNK).publish(load_policy(tiny_policy_dir), 1, 0)
    (store / "v000001" / "secret.txt").write_text("not in the manifest")
    (store / "secret.txt").write_text("outside every version")
    data = (store / "v000001" / "model.safetensors").read_bytes()
    assert _get(addr, "/v000001/model.safetensors") == (200, data)
    assert _get(addr, "/v000001/model.safetensors?chunk=1") == (200, data[CHUNK:2 * CHUNK])
    assert msgspec.json.decode(_get(addr, "/latest")[1], type=PolicyVersion) == pv
    assert json.loads(_get(addr, "/v000001/policy.json")[1])["sha256"] == pv.sha256
    cases = {
        "/v000001/../secret.txt": 400, "/../secret.txt": 400, "/v000001/%2e%2e/secret.txt": 400,
        "/v000001/..%2fsecret.txt": 400, "http://127.0.0.1/etc/passwd": 400, "v000001/model.safetensors": 400,
        "/v000001/model.safetensors?chunk=-1": 400, "/v000001/model.safetensors?path=/etc/passwd": 400,
        "/v000001/manifest.json?chunk=0": 400,
        "//etc/passwd": 404,  # http.server turns a leading // into / (an open-redirect fix): /etc/passwd
        "/v000001/secret.txt": 404, "/secret.txt": 404, "/etc/passwd": 404, "/v000002/model.safetensors": 404,
        "/v1/model.safetensors": 404, "/.v000001.tmp1/model.safetensors": 404, "/v000001": 404, "/": 404,
        "/v000001/model.safetensors?chunk=999": 416,
    }
    got = {path: _get(addr, path)[0] for path in cases}
    assert got == cases
    assert _get(addr, "/v000001/model.safetensors", "POST")[0] == 501  # read-only
    assert _get(addr, "/latest")[0] == 200  # still serving after the bad requests


def test_the_server_down_is_transient_and_the_version_loads_when_it_is_back(tmp_path, tiny_policy_dir):
    store = tmp_path / "store"
    server = WeightServer(store, "127.0.0.1:0").start()
    address = server.address
    server.close()
    bus, run = MemoryBus(), "down"
    follower, engine = _follower(bus, run, f"http://{address}"), make_engine("torch", tiny_policy_dir)
    pv = DirectoryPublisher(store, Announcer(bus.producer(), run), chunk_bytes=CHUNK).publish(
        _model(tiny_policy_dir, 0.03), 1, 1)
    assert not follower.maybe_swap(engine)
    assert follower.failed[1][0] == 1 and "unreachable" in follower.failed[1][2] and not follower.refused
    assert not follower.maybe_swap(engine) and follower.failed[1][0] == 1  # waiting for its backoff (1 s)
    server = WeightServer(store, address).start()  # back on the same address
    try:
        follower.failed[1] = (1, 0.0, follower.failed[1][2])  # the backoff has passed
        assert follower.maybe_swap(engine) and engine.version == pv.version
    finally:
        server.close()


def test_a_pruned_version_is_refused_and_the_next_one_loads(served, tiny_policy_dir):
    server, url, store = served
    bus, run = MemoryBus(), "pruned"
    follower, engine = _follower(bus, run, url), make_engine("torch", tiny_policy_dir)
    publisher = DirectoryPublisher(store, keep=1, chunk_bytes=CHUNK, base_uri=url)
    pv1 = publisher.publish(_model(tiny_policy_dir, 0.01), 1, 1)
    pv2 = publisher.publish(_model(tiny_policy_dir, 0.02), 2, 2)
    assert publisher.versions() == [2]
    announce(bus.producer(), run, pv1)  # announced late: pruned meanwhile
    assert not follower.maybe_swap(engine) and engine.version == 0
    assert "HTTP 404" in follower.refused[1] and "pruned" in follower.refused[1]
    announce(bus.producer(), run, pv2)
    assert follower.maybe_swap(engine) and engine.version == 2


def test_an_agent_with_no_model_starts_from_the_server_once_the_learner_published(served, tiny_policy_dir, tmp_path):
    from streamer.agent.agent import load_engine, parse_args, settings_from_args

    server, url, store = served
    model = _model(tiny_policy_dir, 0.04)
    later = threading.Timer(1.0, lambda: DirectoryPublisher(store, chunk_bytes=CHUNK).publish(model, 3, 30))
    later.start()  # the agent starts first and waits for the learner's first version
    s = settings_from_args(parse_args(["--run", "r", "--model", f"{url}/latest",
                                       "--set", f"model_cache={tmp_path / 'cache'}"]))
    assert (s.weights_transport, s.weights_url) == ("http", url)
    t0 = time.monotonic()
    engine, tokenizer = load_engine(s)
    later.join()
    assert engine.version == 3 and time.monotonic() - t0 >= 0.9
    loaded = engine.model.state_dict()
    assert all(torch.equal(loaded[name], t) for name, t in model.state_dict().items())
    [copy] = (tmp_path / "cache").iterdir()
    assert {"config.json", "sao_tokenizer.json", "model.safetensors"} <= {f.name for f in copy.iterdir()}
    path, pv, _ = fetch_model(url, "v000003", tmp_path / "cache")  # a named version; the complete copy is reused
    assert path == copy and pv.version == 3
    with pytest.raises(CheckpointError, match="no latest version after 0 s"):
        fetch_model("http://127.0.0.1:9", "latest", tmp_path / "none", wait_s=0)


def test_agents_of_one_host_fetching_into_one_cache_never_delete_each_others_copy(served, tiny_policy_dir,
                                                                                   tmp_path):
    """Two agents of one host start together on one model cache: each gets a complete, verified copy, and the copy
    the first one returned stays in place while the second installs (its own copy is dropped, not swapped in)."""
    from concurrent.futures import ThreadPoolExecutor

    server, url, store = served
    DirectoryPublisher(store, chunk_bytes=CHUNK).publish(_model(tiny_policy_dir, 0.05), 1, 10)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fetch_model(url, "latest", cache), range(4)))
    [copy] = cache.iterdir()  # one copy, no temporary directory left behind
    first = (copy / "model.safetensors").stat().st_ino
    assert all(path == copy and pv.version == 1 for path, pv, _ in results)
    fetch_model(url, "latest", cache)  # a later agent reuses it: the same file, never rewritten
    assert (copy / "model.safetensors").stat().st_ino == first


def test_the_learner_serves_its_store_and_announces_http_uris(tmp_path, tiny_policy_dir):
    from learner.train import build_outputs

    cfg = LearnerConfig()
    cfg.io.trajectories, cfg.io.weights_dir = str(tmp_path / "none.jsonl"), str(tmp_path / "weights")
    cfg.io.weights_transport, cfg.io.weights_bind = "http", "127.0.0.1:0"
    cfg.checkpoint.dir = str(tmp_path / "ckpt")
    cfg.validate()
    publisher, _, closers = build_outputs(cfg)
    try:
        assert publisher.keep == 4 and publisher.store.chunk_bytes == 4 * 1024 * 1024
        pv = publisher.publish(load_policy(tiny_policy_dir), 0, 0)
        base = pv.uri.rpartition("/")[0]
        assert base.startswith("http://127.0.0.1:") and pv.uri.endswith("/v000000")
        assert HttpWeightSource(base).latest() == pv
    finally:
        for close in closers:
            close()
    with pytest.raises(CheckpointError, match="unreachable") as e:
        HttpWeightSource(base).latest()
    assert e.value.transient


def test_one_launch_setting_sets_both_sides_and_the_sections_refuse_it(tmp_path):
    from streamer.agent.agent import parse_args as agent_args
    from streamer.agent.agent import settings_from_args
    from streamer.launch.run_config import load_run_config
    from streamer.launch.up import parse_args
    from streamer.wire.config import load_config, write_yaml

    plain = load_run_config(None, [])
    assert plain.learner.io.weights_transport == plain.agent.weights_transport == "directory"
    assert plain.learner.io.versions_kept() == 32
    cfg = parse_args(["--run", "h", "--runs-dir", str(tmp_path), "--set", "launch.weights_transport=http"])
    io, agent = cfg.learner.io, cfg.agent
    port = int(io.weights_bind.rpartition(":")[2])
    assert io.weights_transport == agent.weights_transport == "http" and port > 0
    assert io.weights_bind == io.weights_advertised == f"127.0.0.1:{port}"
    assert agent.weights_url == f"http://{io.weights_bind}"
    assert io.versions_kept() == 4
    path = tmp_path / "config.yaml"
    write_yaml(cfg, path)
    assert load_config(LearnerConfig, path, section="learner").io.weights_transport == "http"
    s = settings_from_args(agent_args(["--config", str(path)]))
    assert (s.weights_transport, s.weights_url) == ("http", agent.weights_url)
    wide = load_run_config(None, ["launch.weights_transport=http", "launch.weights_bind=0.0.0.0:8799",
                                  "launch.weights_advertised=learner-host:8799"])
    assert (wide.learner.io.weights_bind, wide.agent.weights_url) == ("0.0.0.0:8799", "http://learner-host:8799")
    for key in ("agent.weights_transport=http", "agent.weights_url=http://x:1", "learner.io.weights_transport=http",
                "learner.io.weights_bind=0.0.0.0:1"):
        with pytest.raises(ConfigError, match=f"{key.partition('=')[0]}: sao up derives it"):
            load_run_config(None, [key])
    with pytest.raises(ConfigError, match="launch.weights_transport"):
        load_run_config(None, ["launch.weights_transport=ftp"])
    with pytest.raises(ConfigError, match="launch.weights_bind: 'nowhere' is not HOST:PORT"):
        load_run_config(None, ["launch.weights_transport=http", "launch.weights_bind=nowhere"])


def test_settings_name_the_field_at_fault(tmp_path):
    with pytest.raises(ConfigError, match="AgentSettings.weights_url"):
        AgentSettings(weights_transport="http").validate()
    with pytest.raises(ConfigError, match="AgentSettings.model"):
        AgentSettings(weights_transport="http", weights_url="http://a:1", model="http://b:2/latest").validate()
    with pytest.raises(ConfigError, match="AgentSettings.model: .* end it with /latest"):
        AgentSettings(weights_transport="http", weights_url="http://a:1", model="http://a:1/x").validate()
    cfg = LearnerConfig()
    cfg.io.weights_transport, cfg.io.weights_dir, cfg.io.weights_bind = "http", str(tmp_path), "8765"
    with pytest.raises(ConfigError, match="LearnerConfig.io.weights_bind"):
        cfg.validate()
    cfg.io.weights_bind, cfg.io.weights_chunk_bytes = "127.0.0.1:0", 0
    with pytest.raises(ConfigError, match="LearnerConfig.io.weights_chunk_bytes"):
        cfg.validate()


def test_the_evaluator_follows_the_same_server(tmp_path):
    from streamer.agent.evaluator import parse_args, settings_from_args
    from streamer.launch.run_config import load_run_config
    from streamer.launch.up import roles

    s = settings_from_args(parse_args(["--run", "e", "--weights-url", "http://127.0.0.1:8765"]))
    assert (s.weights_transport, s.weights_url) == ("http", "http://127.0.0.1:8765")
    cfg = load_run_config(None, ["launch.weights_transport=http", "launch.eval=true", "launch.cores=4"])
    [ev] = [r for r in roles(cfg, tmp_path / "config.yaml", tmp_path, "127.0.0.1:9092") if r.name == "eval"]
    assert ev.argv[ev.argv.index("--weights-url") + 1] == cfg.agent.weights_url


def test_sao_weights_serve_serves_a_store_on_its_own(tmp_path, tiny_policy_dir):
    import signal
    import subprocess

    from streamer.transport.broker import free_port

    pv = DirectoryPublisher(tmp_path / "store").publish(load_policy(tiny_policy_dir), 5, 50)
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "streamer.launch.cli", "weights-serve", "--dir",
                             str(tmp_path / "store"), "--bind", address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("sao weights-serve:")  # listening
        assert HttpWeightSource(f"http://{address}").latest() == pv
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def short_up(tmp_path, run: str, transport: str, agents: int) -> tuple:
    """`sao up --weights-transport TRANSPORT` on the smoke scenario, shortened (192 tasks, a 30-step warm start), run
    to its end: (the run directory, its config.yaml as a dict), after checking every task was answered and the
    transport reached both sections."""
    import subprocess

    import yaml

    cmd = [sys.executable, "-m", "streamer.launch.cli", "up", "--run", run, "--runs-dir", str(tmp_path), "--scenario",
           "smoke", "--no-dashboard", "--no-eval", "--agents", str(agents), "--cores", "2", "--batch", "32",
           "--limit", "192", "--set", "pretrain.steps=30", "--set", "pretrain.eval_every=0",
           "--weights-transport", transport, "--max-seconds", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    run_dir = tmp_path / run
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "scenario finished: every task answered"
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["agent"]["weights_transport"] == cfg["learner"]["io"]["weights_transport"] == transport
    return run_dir, cfg


@pytest.mark.slow
@pytest.mark.kafka
def test_up_runs_the_pipeline_with_agents_pulling_over_http(tmp_path):
    """`sao up --weights-transport http` on the smoke scenario, shortened (one agent, 192 tasks, a 30-step warm start):
    every task answered, the agent loaded versions from the learner's weight server and refused none."""
    run_dir, cfg = short_up(tmp_path, "h", "http", agents=1)
    url = cfg["agent"]["weights_url"]
    assert f"weight server: {run_dir / 'weights'} on {url}" in (run_dir / "logs" / "learner.log").read_text()
    status = json.loads((run_dir / "agent-0.json").read_text())
    assert status["version"] >= 2 and status["refused"] == {} and status["tasks"] == 192
    pulled = (run_dir / "logs" / "agent-0.log").read_text().count(f"loaded from {url} ")
    assert pulled >= 2  # versions came over HTTP (the agent skips a version when a newer one is out)
    assert len(list((run_dir / "weights").glob("v*"))) <= 4  # older versions pruned (keep 4 over http)

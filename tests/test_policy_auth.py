"""Policy announcements are authenticated, and one that lies steers nothing (issue 50 items 3 and 6); the weight store
is fsynced (item 4); secrets stay out of config.yaml.

A forged `PolicyVersion` of version 10^15 once made every agent refuse it, then ignore every later real version and
pace on 10^15; the policy topic is read from the start, so it survived restarts. Here the forgeries are real records on
the real policy topic of the embedded broker, read by the follower an agent builds (`build_agent`'s consumer).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch

from learner.engines import make_engine
from learner.models import load_policy
from learner.trainer.publish import DirectoryPublisher
from streamer.transport import signing
from streamer.transport.kafka_bus import read_topic
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.weights import Announcer, PolicyFollower, WeightStore, announce
from streamer.wire.schema import DeadLetter, PolicyVersion, decode, encode
from streamer.wire.settings import ClientSettings
from streamer.wire.topics import Topics, partitions_by_topic

KEY = "0123456789abcdef0123456789abcdef"  # 32 characters: its UTF-8 bytes are the HMAC key


def _perturbed(model_dir: Path, scale: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(scale * 1000))
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in load_policy(model_dir).state_dict().items()}


def test_the_signature_is_hmac_sha256_over_the_canonical_fields():
    """The bytes signed and the HMAC, written out by hand; the HMAC as `openssl dgst -sha256 -hmac KEY` gives it for
    those bytes (1f0de8bb...), and as Python's hmac computes it."""
    pv = PolicyVersion(version=7, uri="/runs/exp1/weights/v000007", sha256="ab" * 32, step=70, created_at=1700000000.5)
    text = ('["sao-policy/1","exp1.policy",1,7,70,"/runs/exp1/weights/v000007",'
            '"abababababababababababababababababababababababababababababababab","",1700000000.5]')
    expected = "1f0de8bbb8e83d806aa415e58f10f916227d8fe9e37f9a9ade11040195430b6f"
    assert signing.canonical(pv, "exp1.policy") == text.encode()
    assert hmac.new(KEY.encode(), text.encode(), hashlib.sha256).hexdigest() == expected
    good = signing.signed(pv, "exp1.policy", KEY.encode())
    assert good.sig == expected and signing.unverified(good, "exp1.policy", KEY.encode()) == ""
    # any field changed, another run's topic, another key, or no signature: refused, the reason naming the signature
    for forged, topic, key in [(msgspec.structs.replace(good, version=10**15), "exp1.policy", KEY),
                               (msgspec.structs.replace(good, sha256="cd" * 32), "exp1.policy", KEY),
                               (msgspec.structs.replace(good, sig="é" * 64), "exp1.policy", KEY),
                               (good, "exp2.policy", KEY), (good, "exp1.policy", "another-key-of-32-characters....")]:
        assert "signature does not match" in signing.unverified(forged, topic, key.encode())
    assert "signature missing" in signing.unverified(pv, "exp1.policy", KEY.encode())
    assert signing.unverified(pv, "exp1.policy", None) == ""  # no key (one host, by hand): unsigned accepted
    with pytest.raises(signing.ConfigError, match="at least 16"):
        signing.policy_key({signing.KEY_ENV: "short"})


@pytest.mark.kafka
def test_forged_announcements_on_the_policy_topic_are_dead_lettered_and_steer_nothing(
        kafka_bus, kafka_run, bootstrap, tiny_policy_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(signing.KEY_ENV, KEY)  # as `sao up` hands it to every role
    run, t = kafka_run, Topics(kafka_run)
    kafka_bus.create_topics(partitions_by_topic(run))
    producer = kafka_bus.producer()
    store = tmp_path / "store"
    publisher = DirectoryPublisher(store, Announcer(producer, run))  # the learner's announcer: signs

    def follower(version: int) -> PolicyFollower:  # as build_agent makes it: every announcement, the run's DLQ
        consumer = kafka_bus.consumer({t.policy: PolicyVersion}, group_id=None, dlq=t.dlq, producer=producer,
                                      fetch_max_wait_ms=50)
        return PolicyFollower(consumer, WeightStore(store), version=version)

    def swap_until(f: PolicyFollower, engine, version: int) -> None:
        deadline = time.monotonic() + 20
        while engine.version != version and time.monotonic() < deadline:
            f.maybe_swap(engine, timeout=0.2)
        assert engine.version == version

    engine = make_engine("torch", tiny_policy_dir)
    agent = follower(0)
    v1 = publisher.store.publish(_perturbed(tiny_policy_dir, 0.01), 1, 10)
    publisher.announcer(v1)
    swap_until(agent, engine, 1)

    # the poison: v10^15 unsigned, with a wrong HMAC, and one pointing at v1's real files (loadable, were it taken)
    poison = PolicyVersion(version=10**15, uri=str(store / "v1000000000000000"), sha256=v1.sha256, step=10**15)
    on_v1 = msgspec.structs.replace(poison, uri=v1.uri)
    forged = [poison, signing.signed(poison, t.policy, b"not-the-run-key-but-long-enough"),
              msgspec.structs.replace(on_v1, sig="00" * 32)]
    for pv in forged:
        producer.send_raw(t.policy, encode(pv), key=b"policy")
    producer.flush()
    with caplog.at_level(logging.WARNING):
        for version in (2, 3):  # the next real versions, signed
            publisher.publish(load_policy(tiny_policy_dir), version, version * 10)
            swap_until(agent, engine, version)
    assert agent.consumer.dead_letters == 3 and agent.consumer.dead_by_reason["invalid"] == 3
    assert 10**15 not in agent.refused and 10**15 not in agent.announced and agent.newest.version == 3
    assert agent.pace_version(engine.version) == 3  # not 10^15
    letters = [decode(v, DeadLetter) for _, _, v in read_topic(bootstrap, ClientSettings(), t.dlq)]
    assert len(letters) == 3 and all(d.topic == t.policy and d.expected == "PolicyVersion" for d in letters)
    assert ["signature missing" in d.reason for d in letters] == [True, False, False]
    assert all("signature does not match" in d.reason for d in letters[1:])
    assert [decode(d.value, PolicyVersion).version for d in letters] == [10**15] * 3
    assert "signature" in caplog.text

    # a restarted agent reads the topic from the start again: the poison is refused again, and still moves nothing
    agent.consumer.close()
    again = follower(int(engine.version))
    deadline = time.monotonic() + 20
    while (again.newest is None or again.newest.version < 3) and time.monotonic() < deadline:
        assert again.poll(timeout=0.2) is None  # v1 to v3 are not above the engine's v3; the poison is not taken
    assert again.newest.version == 3 and again.announced == {} and again.refused == {}
    assert again.pace_version(engine.version) == 3
    letters = [decode(v, DeadLetter) for _, _, v in read_topic(bootstrap, ClientSettings(), t.dlq)]
    assert {d.offset for d in letters} == {d.offset for d in letters[:3]}  # the same three records, if resent
    publisher.publish(load_policy(tiny_policy_dir), 4, 40)
    swap_until(again, engine, 4)
    again.consumer.close()


def test_a_verified_version_far_ahead_moves_pacing_only_once_loaded(tmp_path, tiny_policy_dir):
    """Signed with the run's key (a learner bug, or a leaked key): a version far ahead that cannot be loaded, or
    that names an older version's files, neither blocks the versions after it nor moves the pacing; a real version
    refused right after the loaded one still does (waiting for it would stall the run)."""
    bus, run, key = MemoryBus(), "ahead", KEY.encode()
    store, prod, engine = WeightStore(tmp_path), bus.producer(), make_engine("torch", tiny_policy_dir)
    f = PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), store, key=key)
    v1 = store.publish(_perturbed(tiny_policy_dir, 0.01), 1, 1)
    announce(prod, run, v1, key=key)
    assert f.maybe_swap(engine) and engine.version == 1
    far = PolicyVersion(version=10**15, uri=str(tmp_path / "v1000000000000000"), sha256=v1.sha256, step=1)
    announce(prod, run, far, key=key)  # no such directory: unreadable, retried with a backoff
    announce(prod, run, msgspec.structs.replace(far, version=10**15 + 1, uri=v1.uri), key=key)  # v1's files
    assert not f.maybe_swap(engine) and "does not end in a version directory" in f.refused[10**15 + 1]
    assert not f.maybe_swap(engine) and f.failed[10**15][0] == 1 and f.pace_version(engine.version) == 1
    announce(prod, run, store.publish(_perturbed(tiny_policy_dir, 0.02), 2, 2), key=key)
    assert f.maybe_swap(engine) and engine.version == 2  # while v10^15 waits for its retry
    assert f.pace_version(engine.version) == 2

    v3 = store.publish(_perturbed(tiny_policy_dir, 0.03), 3, 3)
    announce(prod, run, msgspec.structs.replace(v3, sha256="0" * 64), key=key)  # a real version, refused
    f.failed[10**15] = (1, time.monotonic() + 3600, "")  # v10^15 still waiting
    assert not f.maybe_swap(engine) and 3 in f.refused and f.pace_version(engine.version) == 3
    f.refused[10**15] = "gone"
    assert f.pace_version(engine.version) == 3  # refused far ahead: no effect


def test_config_yaml_holds_no_password_and_the_roles_get_it_and_the_key_in_their_environment(tmp_path, monkeypatch):
    from streamer.launch.processes import Role, Supervisor
    from streamer.launch.run_config import load_run_config, write_run_config
    from streamer.wire.config import load_config
    from streamer.wire.settings import AgentSettings

    password = "pw-9f3c1e7a-never-on-disk"
    for var in ("SAO_KAFKA_SASL_PASSWORD", signing.KEY_ENV, signing.KEY_FILE_ENV):
        monkeypatch.delenv(var, raising=False)
    sets = ["agent.client.security.security_protocol=SASL_SSL", "agent.client.security.sasl_mechanism=SCRAM-SHA-512",
            "agent.client.security.sasl_username=sao", f"agent.client.security.sasl_password={password}"]
    cfg = load_run_config(None, sets, {"runs_dir": str(tmp_path / "runs"), "run": "secret", "agents": 1})
    config_file = tmp_path / "runs" / "secret" / "config.yaml"
    env = write_run_config(cfg, config_file)
    assert password not in config_file.read_text() and "sasl_password: ''" in config_file.read_text()
    key_file = config_file.parent / signing.KEY_FILE
    assert env == {"SAO_KAFKA_SASL_PASSWORD": password, signing.KEY_ENV: key_file.read_text()}
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(env[signing.KEY_ENV]) == 64
    assert write_run_config(cfg, config_file) == env  # a resumed run keeps its key
    assert cfg.agent.client.security.sasl_password == password  # `sao up` itself still has it

    sup = Supervisor(tmp_path / "logs", env=env)  # as `sao up` starts the roles
    role = sup.start(Role("server", ["weights-serve", "--dir", str(tmp_path), "--bind", "127.0.0.1:0"]))
    try:
        environ = b""
        deadline = time.monotonic() + 20
        while b"streamer.launch.cli" not in Path(f"/proc/{role.proc.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        environ = Path(f"/proc/{role.proc.pid}/environ").read_bytes()
    finally:
        sup.stop_all()
    child = dict(kv.split(b"=", 1) for kv in environ.split(b"\0") if b"=" in kv)
    assert child[b"SAO_KAFKA_SASL_PASSWORD"] == password.encode()
    assert child[signing.KEY_ENV.encode()] == env[signing.KEY_ENV].encode()
    # a role reads its section of the file: the empty password comes from the environment
    monkeypatch.setenv("SAO_KAFKA_SASL_PASSWORD", password)
    agent = load_config(AgentSettings, config_file, section="agent")
    assert agent.client.security.resolved().sasl_password == password


def test_sasl_plain_over_plaintext_is_warned_about_once(monkeypatch, caplog):
    from streamer.wire import settings

    monkeypatch.setattr(settings, "_warned", set())
    plain = settings.KafkaSecurity("SASL_PLAINTEXT", "PLAIN", "sao", "pw")
    with caplog.at_level(logging.WARNING, logger="streamer.wire.settings"):
        settings.KafkaSecurity("SASL_PLAINTEXT", "SCRAM-SHA-256", "sao", "pw").resolved()
        settings.KafkaSecurity("SASL_SSL", "PLAIN", "sao", "pw").resolved()
        assert caplog.records == []
        plain.kafka_python()
        plain.resolved()
    assert len(caplog.records) == 1 and "PLAIN over SASL_PLAINTEXT" in caplog.text
    assert "UNENCRYPTED" in caplog.text


STRACE_PUBLISH = """
import sys, torch
from streamer.transport.weights import WeightStore
WeightStore(sys.argv[1]).publish({"w": torch.ones(4)}, 1, 1, side_files_from=sys.argv[2])
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_published_version_is_fsynced_files_then_directory_then_the_store(tmp_path):
    """Read off the system calls a real publish makes (strace): each file fsynced, then its directory, before the
    rename; the store's directory after it."""
    side = tmp_path / "side"
    side.mkdir()
    (side / "config.json").write_text("{}")
    store, trace = tmp_path / "store", tmp_path / "trace"
    cmd = ["strace", "-f", "-y", "-o", str(trace), "-e", "trace=fsync,fdatasync,rename,renameat,renameat2",
           sys.executable, "-c", STRACE_PUBLISH, str(store), str(side)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    if done.returncode != 0 and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    ops = []  # (call, path...) of the calls that touch the store
    for line in trace.read_text().splitlines():
        if m := re.search(r"fsync\(\d+<([^>]*)>\)", line):
            ops.append(("fsync", m[1]))
        elif "rename" in line and "resumed" not in line:
            ops.append(("rename", *re.findall(r'"([^"]*)"', line)))
    ops = [op for op in ops if op[1].startswith(str(store))]
    tmp = next(op[1] for op in ops if op[0] == "rename")
    files = ["config.json", "manifest.json", "model.safetensors", "policy.json"]
    assert sorted(ops[:4]) == [("fsync", f"{tmp}/{name}") for name in files]  # every file of the version
    assert ops[4:] == [("fsync", tmp), ("rename", tmp, f"{store}/v000001"), ("fsync", str(store))]
    assert [p.name for p in store.iterdir()] == ["v000001"]  # no temporary left


@pytest.mark.slow  # `sao up` end to end: 75 s on 2 busy cores
@pytest.mark.kafka
def test_sao_up_signs_every_announcement_and_its_agents_verify_them(tmp_path, monkeypatch):
    """`sao up` makes the run's key, the learner signs with it and the agent, holding it too, takes every version:
    none refused, no dead letter, no role unauthenticated; the key is in no log and not in config.yaml."""
    import json

    from test_weight_pull import short_up

    for var in (signing.KEY_ENV, signing.KEY_FILE_ENV):
        monkeypatch.delenv(var, raising=False)
    run_dir, _ = short_up(tmp_path, "signed", "directory", agents=1)
    key = (run_dir / signing.KEY_FILE).read_text()
    assert len(key) == 64 and (run_dir / signing.KEY_FILE).stat().st_mode & 0o777 == 0o600
    status = json.loads((run_dir / "agent-0.json").read_text())
    assert status["version"] >= 2 and status["refused"] == {} and status["dead_letters"] == 0
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("*.log")}
    assert logs["agent-0.log"].count("loaded from") >= 2
    assert not any("NOT authenticated" in text or key in text for text in logs.values())
    assert key not in (run_dir / "config.yaml").read_text()


@pytest.mark.slow  # a local Ray cluster starts (10-15 s on 2 busy cores)
def test_the_run_key_reaches_the_roles_ray_starts(tmp_path, monkeypatch):
    """A Ray actor's role gets the environment `sao up` hands its supervisor, the run's key in it (not inherited:
    the driver's own environment has none)."""
    import json

    from role_stub import role_script

    ray = pytest.importorskip("ray")
    from streamer.launch.processes import Role
    from streamer.launch.ray_launch import RaySupervisor, ray_config

    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    key = signing.run_key(tmp_path / "run", env={})
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    sup = RaySupervisor(tmp_path / "logs", {"OUT": str(out), "SAO_RUN": "keyed", signing.KEY_ENV: key},
                        ray_config("", ["agent.num_cpus=0.5"]))
    sup.entry = ["-c", role_script(f"rec = {{'key': os.environ.get({signing.KEY_ENV!r})}}")]
    try:
        sup.start(Role("agent-0", ["agent"]))
        deadline = time.monotonic() + 60
        while not list(out.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        records = [json.loads(p.read_text()) for p in out.glob("*.json")]
    finally:
        sup.stop_all()
        ray.shutdown()
    assert records == [{"key": key}]

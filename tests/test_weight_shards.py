"""Sharded versions in the weight store (issue 48 item 4): each rank's shard written into the version, the
announcement covering every shard, agents merging them from the directory or over HTTP, anything tampered refused.

The megatron ranks that write the shards are in tests/test_megatron_publish.py; here the shards come from the tiny
policy's state dict split by hand, through the same writer (`streamer.transport.weight_shards`)."""

from __future__ import annotations

import hashlib
import json

import msgspec
import pytest
import torch

from learner.engines import make_engine
from learner.models import load_policy
from learner.models.tokenizer import CharTokenizer
from learner.trainer.publish_shards import publish_sharded
from streamer.transport import weight_shards
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.weight_client import HttpWeightSource, fetch_model
from streamer.transport.weight_server import WeightServer
from streamer.transport.weights import (
    INDEX_FILE,
    MANIFEST_FILE,
    Announcer,
    CheckpointError,
    Manifest,
    PolicyFollower,
    WeightStore,
    manifest_entry,
    merge_shards,
    side_files,
)
from streamer.wire.schema import PolicyVersion
from streamer.wire.topics import Topics

CHUNK = 8 * 1024  # the tiny policy (~80 KB) in 3 shards: several chunks each


def _state(model_dir, scale: float = 0.0) -> dict[str, torch.Tensor]:
    model = load_policy(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale)
    sd = model.state_dict()
    sd.pop("lm_head.weight", None)  # tied: the embedding (the store keeps it once, under the embedding's name)
    return sd


def _publish(store: WeightStore, state: dict, version: int, model_dir, parts: int = 3) -> PolicyVersion:
    """`state` as `parts` shards (keys dealt round robin, bf16 in the last shard), as `parts` ranks write them."""
    staging = weight_shards.begin(store, version)
    names = list(state)
    for i in range(parts):
        mine = [(n, state[n]) for n in names[i::parts]]
        plan = [(n, t.dtype, tuple(t.shape)) for n, t in mine]
        weight_shards.write_shard(staging, i, parts, plan, iter(mine), store.chunk_bytes)
    return weight_shards.commit(store, staging, version, step=10 * version, count=parts, side_files_from=model_dir)


def _assert_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture
def served(tmp_path):
    store = tmp_path / "store"
    server = WeightServer(store, "127.0.0.1:0").start()
    yield server, f"http://{server.address}", WeightStore(store, CHUNK)
    server.close()


def test_a_sharded_version_is_announced_by_the_digest_of_its_files_and_merges_bit_for_bit(served, tiny_policy_dir):
    _, url, store = served
    state = _state(tiny_policy_dir, 0.01)
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.bfloat16)  # shards keep each tensor's dtype
    pv = _publish(store, state, 1, tiny_policy_dir)
    vdir = store.path_of(1)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in vdir.iterdir()) == sorted(
        [*shards, INDEX_FILE, MANIFEST_FILE, "policy.json", *(f.name for f in side_files(tiny_policy_dir))])
    index = json.loads((vdir / INDEX_FILE).read_text())
    assert index["weight_map"]["model.embed_tokens.weight"] == shards[0]
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    manifest = msgspec.json.decode((vdir / MANIFEST_FILE).read_bytes(), type=Manifest)
    assert manifest.weights == [*shards, INDEX_FILE] and [f.name for f in manifest.files[:4]] == manifest.weights
    # the announced sha256: over "<sha256>  <name>\n" of each shard then the index, as sha256sum prints them
    lines = "".join(f"{hashlib.sha256((vdir / n).read_bytes()).hexdigest()}  {n}\n" for n in manifest.weights)
    assert pv.sha256 == manifest.sha256 == hashlib.sha256(lines.encode()).hexdigest()
    assert store.latest() == pv
    _assert_equal(store.load(pv), state)  # the directory
    _assert_equal(HttpWeightSource(url).load(pv), state)  # chunk by chunk over HTTP, into memory
    # a version directory is an HF sharded checkpoint: from_pretrained reads it
    model = load_policy(vdir)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_an_agent_follows_sharded_versions_over_http_and_starts_from_one(served, tiny_policy_dir, tmp_path):
    _, url, store = served
    bus, run = MemoryBus(), "s"
    follower = PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), HttpWeightSource(url))
    announcer = Announcer(bus.producer(), run)
    engine = make_engine("torch", tiny_policy_dir)
    state = _state(tiny_policy_dir, 0.02)
    announcer(_publish(store, state, 2, tiny_policy_dir))
    assert follower.maybe_swap(engine) and follower.version == 2
    loaded = engine.model.state_dict()
    for k, t in state.items():
        assert torch.equal(loaded[k], t), k
    path, pv, got = fetch_model(url, "latest", tmp_path / "cache")  # an agent with no model: the directory too
    assert pv.version == 2 and (path / INDEX_FILE).is_file()
    _assert_equal(got, state)
    assert fetch_model(url, "v000002", tmp_path / "cache")[0] == path  # the verified copy is reused


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_tampered_shard_manifest_or_index_is_refused(served, tiny_policy_dir):
    _, url, store = served
    state = _state(tiny_policy_dir)
    pv = _publish(store, state, 3, tiny_policy_dir)
    vdir, http = store.path_of(3), HttpWeightSource(url)
    shard = vdir / "model-00002-of-00003.safetensors"
    _flip(shard, shard.stat().st_size - 5)  # a weight's byte in shard 2
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors has sha256") as e:
        store.load(pv)
    assert not e.value.transient
    with pytest.raises(CheckpointError, match="chunk .* of model-00002-of-00003.safetensors .*refused"):
        http.load(pv)
    # the manifest rewritten to the tampered shard's sha256: it no longer digests to the announcement
    manifest = msgspec.json.decode((vdir / MANIFEST_FILE).read_bytes(), type=Manifest)
    forged = [manifest_entry(f.name, shard.read_bytes(), CHUNK) if f.name == shard.name else f
              for f in manifest.files]
    (vdir / MANIFEST_FILE).write_bytes(msgspec.json.encode(msgspec.structs.replace(manifest, files=forged)))
    for source in (store, http):
        with pytest.raises(CheckpointError, match="digest to .* announced .*refused"):
            source.load(pv)
    # a version whose announcement is not the digest of its manifest (e.g. a single file's sha256) is refused
    with pytest.raises(CheckpointError, match="announced"):
        store.load(msgspec.structs.replace(pv, sha256=hashlib.sha256(b"x").hexdigest()))


def test_merging_refuses_a_tensor_in_two_shards_or_where_the_index_does_not_say():
    from safetensors.torch import save

    a, b = save({"x": torch.ones(2)}), save({"x": torch.zeros(2), "y": torch.ones(1)})
    index = json.dumps({"weight_map": {"x": "s1", "y": "s2"}}).encode()
    with pytest.raises(CheckpointError, match="tensor x found in s2, the index says s1"):
        merge_shards(index, [("s1", a), ("s2", b)], "v1")
    with pytest.raises(CheckpointError, match="the index lists 2 tensors, the shards hold 1"):
        merge_shards(index, [("s1", a)], "v1")
    with pytest.raises(CheckpointError, match="is not an index"):
        merge_shards(b"[]", [], "v1")


def test_the_writer_streams_what_it_planned_and_nothing_else(tmp_path):
    from safetensors.torch import load

    ts = {"i": torch.arange(5), "w": torch.randn(3, 7), "s": torch.tensor(1.5), "b": torch.randn(4).bfloat16(),
          "e": torch.zeros(0, 3)}
    plan = [(n, t.dtype, tuple(t.shape)) for n, t in ts.items()]  # widest dtypes first: every tensor aligned
    for chunk in (1, 7, 64, 1 << 20):  # the chunk hashes as manifest_entry computes them on the whole file
        entry = weight_shards.write_safetensors(tmp_path / "a.safetensors", plan, iter(ts.items()), chunk)
        data = (tmp_path / "a.safetensors").read_bytes()
        assert entry == manifest_entry("a.safetensors", data, chunk)
    _assert_equal(load(data), ts)
    with pytest.raises(ValueError, match="planned w .* got s"):
        weight_shards.write_safetensors(tmp_path / "b.safetensors", plan, iter([*ts.items()][:1] + [("s", ts["s"])]),
                                        64)
    with pytest.raises(ValueError, match="more tensors than planned"):
        weight_shards.write_safetensors(tmp_path / "c.safetensors", plan[:2], iter(ts.items()), 64)


class _OneRank:
    """The collectives publish_sharded uses, for a world of one (rank 0)."""

    leader, rank = True, 0

    def share_text(self, text: str) -> str:
        return text

    def share_int(self, x: int) -> int:
        return x

    def all_true(self, ok: bool) -> bool:
        return ok


class _Shard:
    def __init__(self, state: dict) -> None:
        self.index, self.count, self.state = 0, 1, state

    def plan(self):
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

    def tensors(self):
        return iter(self.state.items())


def test_publish_sharded_commits_announces_and_prunes_or_publishes_nothing(tmp_path, tiny_policy_dir):
    from learner.trainer.publish import DirectoryPublisher

    announced: list[PolicyVersion] = []
    publisher = DirectoryPublisher(tmp_path / "w", announced.append, keep=1, tokenizer=CharTokenizer())
    policy = load_policy(tiny_policy_dir)
    state = _state(tiny_policy_dir)
    for v in (1, 2):
        pv = publish_sharded(publisher, _Shard(state), policy.config, v, 7, _OneRank())
        assert announced[-1] == pv and pv.step == 7
    assert [p.version for p in publisher.store.versions()] == [2]  # pruned to keep=1
    _assert_equal(publisher.store.load(announced[-1]), state)
    assert (publisher.store.path_of(2) / "config.json").is_file()
    bad = dict(state, **{"model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))})
    with pytest.raises(RuntimeError, match="non-finite values: refusing to publish it.*nothing was published"):
        publish_sharded(publisher, _Shard(bad), policy.config, 3, 8, _OneRank())
    assert [p.name for p in (tmp_path / "w").iterdir()] == ["v000002"] and len(announced) == 2

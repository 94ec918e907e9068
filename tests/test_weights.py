"""Weight store and policy propagation: sha256-verified checkpoints, announcements, refusals."""

from __future__ import annotations

import hashlib
import logging

import msgspec
import pytest
import torch

from learner.engines import make_engine
from learner.models import load_policy
from streamer.transport.memory_bus import MemoryBus
from streamer.transport.weights import Announcer, CheckpointError, PolicyFollower, WeightStore, announce
from streamer.wire.schema import PolicyVersion
from streamer.wire.topics import Topics


def _perturbed(model_dir, scale: float) -> dict[str, torch.Tensor]:
    model = load_policy(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale)
    return model.state_dict()


def test_publish_writes_a_verifiable_checkpoint(tmp_path, tiny_policy_dir):
    store = WeightStore(tmp_path / "store")
    state = _perturbed(tiny_policy_dir, 0.01)
    pv = store.publish(state, version=3, step=30, side_files_from=tiny_policy_dir)
    file = tmp_path / "store" / "v000003" / "model.safetensors"
    assert pv.sha256 == hashlib.sha256(file.read_bytes()).hexdigest()
    assert (pv.version, pv.step) == (3, 30) and pv.uri == str(file.parent.resolve())
    assert (file.parent / "config.json").is_file() and (file.parent / "sao_tokenizer.json").is_file()
    assert store.latest() == msgspec.json.decode((file.parent / "policy.json").read_bytes(), type=PolicyVersion)
    loaded = store.load(pv)
    # the tied lm_head shares the embedding's storage: stored once, under the embedding's name
    assert "lm_head.weight" not in loaded
    for name, t in loaded.items():
        assert torch.equal(t, state[name]), name
    # a published directory is itself a loadable policy
    assert torch.equal(load_policy(file.parent).model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_publish_from_a_model_directory_keeps_its_bytes(tmp_path, tiny_policy_dir):
    pv = WeightStore(tmp_path).publish(tiny_policy_dir, version=1, step=0)
    assert pv.sha256 == hashlib.sha256((tiny_policy_dir / "model.safetensors").read_bytes()).hexdigest()


def test_the_publisher_announces_each_version_it_writes(tmp_path, tiny_policy_dir):
    from learner.trainer.publish import DirectoryPublisher

    bus, run = MemoryBus(), "w"
    follower = PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), WeightStore(tmp_path))
    publisher = DirectoryPublisher(tmp_path, Announcer(bus.producer(), run), keep=1)
    engine = make_engine("torch", tiny_policy_dir)
    for version in (1, 2):
        pv = publisher.publish(load_policy(tiny_policy_dir), version, step=10 * version)
        assert follower.poll() == pv  # announced by the publisher itself, after the write
        assert follower.maybe_swap(engine) and engine.version == version
    assert publisher.versions() == [2]


def test_follower_swaps_to_new_versions_and_refuses_bad_checkpoints(tmp_path, tiny_policy_dir, caplog):
    store, bus, run = WeightStore(tmp_path), MemoryBus(), "w"
    engine = make_engine("torch", tiny_policy_dir)
    follower = PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), store)
    prod = bus.producer()
    assert not follower.maybe_swap(engine)  # nothing announced yet

    v1_state = _perturbed(tiny_policy_dir, 0.01)
    announce(prod, run, store.publish(v1_state, version=1, step=10))
    assert follower.maybe_swap(engine) and engine.version == 1 and follower.version == 1
    emb = engine.model.model.embed_tokens.weight
    assert torch.equal(emb, v1_state["model.embed_tokens.weight"])

    good2 = store.publish(_perturbed(tiny_policy_dir, 0.02), version=2, step=20)
    announce(prod, run, msgspec.structs.replace(good2, sha256="0" * 64))  # wrong hash
    with caplog.at_level(logging.ERROR, logger="streamer.transport.weights"):
        assert not follower.maybe_swap(engine)
    assert engine.version == 1 and torch.equal(engine.model.model.embed_tokens.weight, emb)
    assert "policy v2 REFUSED, keeping v1" in caplog.text and "announced 000000000000" in caplog.text
    assert 2 in follower.refused
    assert not follower.maybe_swap(engine)  # a refused version is not retried

    pv3 = store.publish(_perturbed(tiny_policy_dir, 0.03), version=3, step=30)
    data = bytearray((store.path_of(3) / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # corrupt one byte after publication
    (store.path_of(3) / "model.safetensors").write_bytes(bytes(data))
    announce(prod, run, pv3)
    assert not follower.maybe_swap(engine) and "has sha256" in follower.refused[3]  # corrupt bytes
    announce(prod, run, PolicyVersion(version=4, uri=str(tmp_path / "v000004"), sha256="ab" * 32, step=40))
    assert not follower.maybe_swap(engine)  # v4: missing, which may pass: tried again later, not refused yet
    assert 4 not in follower.refused and "unreadable" in follower.failed[4][2] and follower.failed[4][0] == 1
    assert engine.version == 1

    announce(prod, run, store.publish(_perturbed(tiny_policy_dir, 0.05), version=5, step=50))
    assert follower.maybe_swap(engine) and engine.version == 5


def test_an_unreadable_version_is_retried_and_a_uri_outside_the_store_is_never_read(tmp_path, tiny_policy_dir):
    """A refused version was never retried, so a transient read failure could stall paced agents; an announced
    uri could point anywhere on disk (issue 14, findings 7 and 9)."""
    import streamer.transport.weights as w

    store, bus, run = WeightStore(tmp_path / "store"), MemoryBus(), "r"
    engine = make_engine("torch", tiny_policy_dir)
    follower = PolicyFollower(bus.consumer({Topics(run).policy: PolicyVersion}), store)
    pv = store.publish(_perturbed(tiny_policy_dir, 0.01), version=1, step=1)
    weights = store.path_of(1) / "model.safetensors"
    weights.rename(weights.with_suffix(".away"))  # a file system that hiccups
    announce(bus.producer(), run, pv)
    assert not follower.maybe_swap(engine) and follower.failed[1][0] == 1 and not follower.refused
    assert not follower.maybe_swap(engine) and follower.failed[1][0] == 1  # waiting for its backoff (1 s)
    weights.with_suffix(".away").rename(weights)
    follower.failed[1] = (1, 0.0, follower.failed[1][2])  # the backoff has passed
    assert follower.maybe_swap(engine) and engine.version == 1

    pv2 = store.publish(_perturbed(tiny_policy_dir, 0.02), version=2, step=2)
    (store.path_of(2) / "model.safetensors").unlink()  # gone for good
    announce(bus.producer(), run, pv2)
    for _ in range(w.READ_RETRIES):  # refused after READ_RETRIES attempts
        if 2 in follower.failed:
            follower.failed[2] = (follower.failed[2][0], 0.0, "")  # the backoff has passed
        assert not follower.maybe_swap(engine)
    assert "unreadable" in follower.refused[2] and follower.pace_version(engine.version) == 2

    elsewhere = tmp_path / "elsewhere" / "v000003"
    elsewhere.mkdir(parents=True)
    pv3 = store.publish(_perturbed(tiny_policy_dir, 0.03), version=3, step=3)
    (elsewhere / "model.safetensors").write_bytes((store.path_of(3) / "model.safetensors").read_bytes())
    (store.path_of(3) / "model.safetensors").unlink()
    assert store.resolve(msgspec.structs.replace(pv3, uri=str(elsewhere))) == store.path_of(3)


def test_read_verified_names_the_file_and_both_hashes(tmp_path, tiny_policy_dir):
    store = WeightStore(tmp_path)
    pv = store.publish(tiny_policy_dir, version=7, step=0)
    bad = msgspec.structs.replace(pv, sha256="f" * 64)
    with pytest.raises(CheckpointError, match=r"policy v7: .*v000007/model.safetensors has sha256 .* announced ffffff"):
        store.load(bad)

"""Publishing policy versions: weights into the weight store, `PolicyVersion` announcements to listeners.

The learner only needs `publish(model, version, step) -> PolicyVersion` and `latest_version()`.
`DirectoryPublisher` writes through `streamer.transport.weights.WeightStore` (`<store>/v000123/` with
model.safetensors, policy.json, config.json and the tokenizer; written under a temporary name and
renamed, so an agent never loads half a checkpoint), prunes old versions, then announces the new one itself
through its `announcer` (`streamer.transport.weights.Announcer`: to `<run>.policy`), if it has one (a replay
with no agents listening has none). Non-finite weights are refused, never published. Each version's manifest
lists its files in chunks of `chunk_bytes`; with a weight server beside the learner (`io.weights_transport` http),
`base_uri` is that server's advertised address and announcements read `http://HOST:PORT/v000123` (agents take only
the last part and fetch from the server they are configured with). With `broadcast` (`io.weights_transport`
broadcast: a `streamer.transport.weight_broadcast.Broadcaster`'s `offer`), each version is also handed to the sender
of rank 0's group, after it is in the store and before it is announced, and the announcement carries the digest of
its tensors; the call copies the weights and returns at once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Protocol

import torch

from learner.models.lora import adapter_state_dict, merged_state_dict
from learner.models.tokenizer import CharTokenizer, Tokenizer
from streamer.transport.weights import CHUNK_BYTES, WeightStore
from streamer.wire.schema import PolicyVersion


class Publisher(Protocol):
    def publish(self, model: torch.nn.Module, version: int, step: int) -> PolicyVersion: ...

    def latest_version(self) -> int | None: ...


def assert_finite(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise FloatingPointError(f"parameter {name} holds non-finite values: refusing to publish it")


class DirectoryPublisher:
    def __init__(self, store: str | Path, announcer: Callable[[PolicyVersion], None] | None = None,
                 keep: int = 0, tokenizer: Tokenizer | None = None, chunk_bytes: int = CHUNK_BYTES,
                 base_uri: str = "",
                 broadcast: Callable[[dict[str, torch.Tensor], PolicyVersion], PolicyVersion] | None = None,
                 adapters_only: bool = False) -> None:
        """`announcer`: an `Announcer` (or any callable taking the PolicyVersion); None announces nothing.
        `tokenizer`: the policy's, saved with every version (default: the embedded character tokenizer)."""
        self.store = WeightStore(store, chunk_bytes, base_uri)
        self.tokenizer = tokenizer or CharTokenizer()
        self.announcer = announcer
        self.keep = keep  # versions kept on disk (0: all)
        self.broadcast = broadcast
        self.adapters_only = adapters_only  # a LoRA policy's adapters alone (learner.models.lora.adapter_state_dict)

    def versions(self) -> list[int]:
        return sorted(pv.version for pv in self.store.versions())

    def latest_version(self) -> int | None:
        pv = self.store.latest()
        return None if pv is None else pv.version

    def publish(self, model: torch.nn.Module, version: int, step: int) -> PolicyVersion:
        assert_finite(model)
        with tempfile.TemporaryDirectory() as side:  # config.json + tokenizer travel with the weights
            model.config.save_pretrained(side)
            self.tokenizer.save(side)
            # a LoRA policy: its adapters merged, under the HF names, or the adapters alone
            state = adapter_state_dict(model) if self.adapters_only else merged_state_dict(model)
            pv = self.store.publish(state, version, step, side_files_from=side)
        self.store.prune(self.keep)
        if self.broadcast is not None:
            pv = self.broadcast(state, pv)
        if self.announcer is not None:
            self.announcer(pv)
        return pv

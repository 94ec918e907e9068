"""Publishing policy versions: weights to a store, `PolicyVersion` announcements to listeners.

The learner only needs `publish(model, version, step) -> PolicyVersion` and `latest_version()`.
`DirectoryPublisher` is the default store: `<store>/v000123/` holds the HF-format policy directory
(config.json, model.safetensors, tokenizer), written under a temporary name and renamed, so an agent
never loads half a checkpoint. `announce` callbacks (e.g. a Kafka send to `<run>.policy`) run after.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Protocol

import torch

from learner.models.policy import save_policy
from learner.models.tokenizer import CharTokenizer
from streamer.schema import PolicyVersion

_VDIR = re.compile(r"^v(\d{6,})$")


class Publisher(Protocol):
    def publish(self, model: torch.nn.Module, version: int, step: int) -> PolicyVersion: ...

    def latest_version(self) -> int | None: ...


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def assert_finite(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise FloatingPointError(f"parameter {name} holds non-finite values: refusing to publish it")


class DirectoryPublisher:
    def __init__(self, store: str | Path, announce: list[Callable[[PolicyVersion], None]] | None = None,
                 keep: int = 0) -> None:
        self.store = Path(store)
        self.announce = list(announce or [])
        self.keep = keep  # versions kept on disk (0: all)

    def versions(self) -> list[int]:
        if not self.store.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.store.iterdir() if (m := _VDIR.match(p.name)))

    def latest_version(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def publish(self, model: torch.nn.Module, version: int, step: int) -> PolicyVersion:
        assert_finite(model)
        final = self.store / f"v{version:06d}"
        tmp = self.store / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_policy(model, tmp, CharTokenizer())
        if final.exists():  # re-published after a learner restart: the newer weights win
            shutil.rmtree(final)
        os.rename(tmp, final)
        msg = PolicyVersion(version=version, uri=str(final.resolve()), sha256=sha256_file(final / "model.safetensors"),
                            step=step, created_at=time.time())
        for fn in self.announce:
            fn(msg)
        if self.keep:
            for old in self.versions()[:-self.keep]:
                shutil.rmtree(self.store / f"v{old:06d}", ignore_errors=True)
        return msg

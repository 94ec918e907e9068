"""Atomic learner checkpoints: models, optimizers, RNG, step and consumed offsets together. No pickle.

    <root>/step_00000120/
        policy.safetensors  value.safetensors        model weights (tied weights stored once)
        optim_policy.safetensors + optim_policy.json optimizer state: tensors + the rest as JSON
        optim_policy.rank00001.safetensors + .json   several ranks (megatron): one per rank, since
                                                     under expert parallelism each rank's AdamW differs
        rng.safetensors                              torch CPU RNG state
        pending.jsonl                                trajectories read but not yet trained on
        state.json                                   step, version, source positions, counters
        manifest.json                                sha256 and size of every file above

Everything is written into `<root>/.tmp-step_...`, fsynced (files, then the directory), and renamed into
place (then the root is fsynced), so a kill -9 or a power cut at any moment leaves either the previous
checkpoint or the new one, never a half-written one. Should a file still be damaged later (a disk, a copy),
`intact_checkpoint` finds it by the manifest and falls back to the newest checkpoint that checks out. Several
ranks: the leader makes the temporary directory (`begin_checkpoint`), every rank writes its
optimizers into it (`save_optimizers`), then the leader writes the rest and renames it
(`finish_checkpoint`); the directory must be shared by the ranks (one machine, or a shared path).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from streamer.wire.schema import Trajectory, decode_json, encode_json

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


def flatten_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch optimizer state_dict -> (tensors for safetensors, JSON-able metadata)."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{idx}/{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    groups = json.loads(json.dumps(sd["param_groups"], default=_json_default))
    return tensors, {"param_groups": groups, "scalars": scalars}


def _json_default(o: Any) -> Any:
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"optimizer param_groups: value of type {type(o).__name__} cannot go to JSON")


def unflatten_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split("/", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, extra in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(extra)
    groups = meta["param_groups"]
    for g in groups:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})


def step_dirs(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "state.json").is_file())


def latest_checkpoint(root: str | Path) -> Path | None:
    dirs = step_dirs(root)
    return dirs[-1] if dirs else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(directory: Path) -> None:
    """Write the manifest of every file in `directory` and fsync them all, the directory last."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size} for p in files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in [*files, directory / MANIFEST, directory]:
        _fsync(p)


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (None when every file matches its manifest)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for name, want in manifest.items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {want['bytes']}"
        if file_sha256(f) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def intact_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint whose files all match their manifest; each newer, damaged one is named in a warning."""
    for path in reversed(step_dirs(root)):
        why = damage(path)
        if why is None:
            return path
        log.warning("checkpoint %s is damaged (%s): falling back to an older one", path, why)
    return None


def save_checkpoint(root: str | Path, step: int, models: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer], state: dict[str, Any],
                    pending: list[Trajectory], keep: int = 2) -> Path:
    tmp = begin_checkpoint(root, step)
    save_optimizers(tmp, optimizers)
    return finish_checkpoint(root, tmp, step, models, state, pending, keep)


def tmp_dir(root: str | Path, step: int, tag: str | None = None) -> Path:
    """The temporary directory of a checkpoint being written (tag: the writer; default its pid)."""
    return Path(root) / f".tmp-step_{step:08d}-{tag or os.getpid()}"


def begin_checkpoint(root: str | Path, step: int, tag: str | None = None) -> Path:
    tmp = tmp_dir(root, step, tag)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _optim_name(name: str, rank: int | None) -> str:
    return f"optim_{name}" if rank is None else f"optim_{name}.rank{rank:05d}"


def save_optimizers(directory: Path, optimizers: dict[str, torch.optim.Optimizer], rank: int | None = None) -> None:
    for name, opt in optimizers.items():
        tensors, meta = flatten_optimizer(opt)
        base = _optim_name(name, rank)
        save_file(tensors, str(directory / f"{base}.safetensors"))
        (directory / f"{base}.json").write_text(json.dumps(meta))


def finish_checkpoint(root: str | Path, tmp: Path, step: int, models: dict[str, torch.nn.Module],
                      state: dict[str, Any], pending: list[Trajectory], keep: int = 2) -> Path:
    """Models, RNG, pending trajectories and state into `tmp`, then rename it to `step_<step>`."""
    root = Path(root)
    final = root / f"step_{step:08d}"
    for name, model in models.items():
        save_model(model, str(tmp / f"{name}.safetensors"))
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    with (tmp / "pending.jsonl").open("wb") as f:
        for t in pending:
            f.write(encode_json(t) + b"\n")
    (tmp / "state.json").write_text(json.dumps(dict(state, step=step), indent=1, sort_keys=True))
    seal(tmp)
    trash = root / f".trash-{final.name}-{os.getpid()}"
    if final.exists():  # the same step saved again (the final save of a run): the new one wins
        os.rename(final, trash)  # a kill from here to the next rename falls back to the previous step
    os.rename(tmp, final)
    _fsync(root)
    shutil.rmtree(trash, ignore_errors=True)
    for old in step_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, models: dict[str, torch.nn.Module],
                    optimizers: dict[str, torch.optim.Optimizer],
                    rank: int | None = None) -> tuple[dict[str, Any], list[Trajectory]]:
    """Restore models, optimizers (this rank's, when saved per rank) and the RNG in place;
    returns (state, pending trajectories)."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path}: not a learner checkpoint (no state.json)")
    for name, model in models.items():
        file = path / f"{name}.safetensors"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no {file.name}; was it saved with a value model?")
        load_model(model, str(file), strict=True)
    for name, opt in optimizers.items():
        base = path / _optim_name(name, rank)
        if not base.with_name(base.name + ".json").is_file():
            raise FileNotFoundError(f"{path}: no {base.name}.json; was it saved by a different backend or "
                                    "number of ranks?")
        meta = json.loads(base.with_name(base.name + ".json").read_text())
        unflatten_optimizer(opt, load_file(str(base.with_name(base.name + ".safetensors"))), meta)
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch_cpu"])
    pending = [decode_json(line, Trajectory) for line in (path / "pending.jsonl").read_bytes().splitlines() if line]
    return json.loads((path / "state.json").read_text()), pending


def clean_tmp(root: str | Path) -> None:
    """Remove half-written checkpoints left by a killed process."""
    root = Path(root)
    if root.is_dir():
        for p in [*root.glob(".tmp-step_*"), *root.glob(".trash-step_*")]:
            shutil.rmtree(p, ignore_errors=True)

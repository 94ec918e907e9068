"""Atomic learner checkpoints: models, optimizers, RNG, step and consumed offsets together. No pickle.

    <root>/step_00000120/
        policy.safetensors  value.safetensors        model weights (tied weights stored once)
        optim_policy.safetensors + optim_policy.json optimizer state: tensors + the rest as JSON
        policy.weights.00001-of-00002.safetensors    megatron: each rank's part of the weights and of the AdamW
          policy.exp_avg.*, policy.exp_avg_sq.*      moments, in HF naming, instead of the files above, with
          optim_policy.hf.json                       AdamW's step and settings; any layout reads them back
                                                     (learner/backends/megatron/ckpt_shards.py)
        optim_policy.hf.safetensors + .hf.json       megatron checkpoints written before that: the moments in HF
                                                     naming, once (still read back: reshard.py)
        optim_policy.rank00001.safetensors + .json   one per rank (megatron checkpoints older still)
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

Faults that a restart cannot mend stop the learner with what to do instead of looping: a full filesystem
(`OutOfSpace`, exit code `EXIT_NO_SPACE`: the temporary directory is removed, and a start with less free space than
the newest checkpoint takes is refused at once), and a directory whose checkpoints are all damaged
(`DamagedCheckpoints`: starting from offset 0 would train every trajectory again; `checkpoint.from_scratch` moves
them into `damaged/` and starts over on purpose).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from streamer.transport.weights import fsync_path
from streamer.wire.config import Refusal
from streamer.wire.schema import Trajectory, decode_json, encode_json

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
log = logging.getLogger(__name__)


class OutOfSpace(OSError):
    """A filesystem the learner writes to is full: names the directory, its free space and what to do."""

    def __str__(self) -> str:
        return self.strerror  # the message alone, without OSError's "[Errno 28] "


class DamagedCheckpoints(Refusal):
    """checkpoint.dir holds checkpoints, none of them intact: the learner refuses to start from zero by itself."""


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




def seal(directory: Path) -> None:
    """Write the manifest of every file in `directory` and fsync them all, the directory last."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {p.name: {"sha256": file_sha256(p), "bytes": p.stat().st_size} for p in files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in [*files, directory / MANIFEST, directory]:
        fsync_path(p)


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


def _named_step_dirs(root: Path) -> list[Path]:
    """Every directory named like a checkpoint, whole or not (one that lost its state.json is a damaged one)."""
    return sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()) if root.is_dir() else []


def intact_checkpoint(root: str | Path, from_scratch: bool = False) -> Path | None:
    """The newest checkpoint whose files all match their manifest; each newer, damaged one is named in a warning.
    None for an empty `root`; `DamagedCheckpoints` when every checkpoint in it is damaged, unless `from_scratch`,
    which moves them into `root/damaged/` (kept for inspection) and returns None: a start from zero on purpose."""
    damaged = []
    for path in reversed(_named_step_dirs(Path(root))):
        why = damage(path)
        if why is None:
            return path
        log.warning("checkpoint %s is damaged (%s): falling back to an older one", path, why)
        damaged.append((path, why))
    if damaged and not from_scratch:
        named = "; ".join(f"{p.name}: {why}" for p, why in damaged)
        raise DamagedCheckpoints(
            f"checkpoint.dir {root}: every checkpoint is damaged ({named}). Starting from zero would train every "
            "trajectory again from offset 0, so the learner stops. Restore the checkpoints from a copy, or start "
            "over on purpose: sao learn --from-scratch (--set checkpoint.from_scratch=true moves them into "
            f"{Path(root) / 'damaged'}), or delete the directory")
    for path, _ in damaged:
        (Path(root) / "damaged").mkdir(exist_ok=True)
        os.rename(path, Path(root) / "damaged" / path.name)
        log.warning("checkpoint %s moved into damaged/: starting over (checkpoint.from_scratch)", path)
    return None


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem of `path` (of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def is_no_space(error: BaseException) -> bool:
    """A write failed on a full filesystem (or quota): an OSError's errno, or the text of safetensors' writer, which
    names only the OS error ("No space left on device (os error 28)")."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in NO_SPACE
    return any(f"(os error {n})" in str(error) for n in NO_SPACE)


def out_of_space(directory: str | Path, what: str, error: BaseException) -> OutOfSpace:
    """The error that ends the learner when `directory`'s filesystem is full (`error`: the failed write's)."""
    cause = getattr(error, "strerror", None) or str(error)
    return OutOfSpace(errno.ENOSPC,
                      f"{what} {directory}: no space left on its filesystem ({free_bytes(directory):,} bytes free; "
                      f"{cause}). The half-written files were removed. Free space there or point {what} elsewhere, "
                      "then start the learner again: it resumes from its newest intact checkpoint")


@contextmanager
def space_guard(directory: str | Path | None, what: str):
    """A write under `directory` (the setting `what` names it) that fails on a full filesystem raises `OutOfSpace`,
    its temporary files removed. None: no guard (a rank that writes only into the leader's directory)."""
    try:
        yield
    except Exception as e:
        if directory is None or isinstance(e, OutOfSpace) or not is_no_space(e):
            raise
        clean_tmp(directory)
        raise out_of_space(directory, what, e) from e


def check_space(root: str | Path) -> None:
    """`OutOfSpace` when `root`'s filesystem has less free space than the newest checkpoint in it takes: the
    learner would redo its steps since that checkpoint and fail again writing the next one."""
    newest = latest_checkpoint(root)
    if newest is None:
        return
    need = sum(p.stat().st_size for p in newest.iterdir() if p.is_file())
    if free_bytes(root) < need:
        raise OutOfSpace(errno.ENOSPC, f"checkpoint.dir {root}: {free_bytes(root):,} bytes free, less than the "
                         f"{need:,} a checkpoint takes ({newest.name}). Free space there or copy the directory "
                         "to a larger filesystem and point checkpoint.dir at it, then start the learner again")


def write_atomic(path: Path, data: bytes) -> None:
    """`data` into `path` through a temporary file, fsynced, renamed, and the directory fsynced."""
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        tmp.write_bytes(data)
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


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
    fsync_path(root)
    shutil.rmtree(trash, ignore_errors=True)
    for old in step_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def layout_free(path: Path, names) -> dict[str, tuple[Path, dict]] | None:
    """{model: (its layout-free optimizer file, meta)} when the checkpoint at `path` has them for every name."""
    files = {n: path / f"optim_{n}.hf.safetensors" for n in names}
    if not all(f.is_file() for f in files.values()):
        return None
    return {n: (f, json.loads(f.with_suffix(".json").read_text())) for n, f in files.items()}


def written_by_shard(path: Path) -> bool:
    """Whether each rank wrote its part of the weights (the megatron backend: learner.backends.megatron.ckpt_shards)."""
    return any(Path(path).glob("policy.weights.*-of-*.safetensors"))


def check_layout(path: Path, mine: dict, reshards: bool = False) -> None:
    """ValueError unless the checkpoint at `path` was written by a learner of layout `mine` (Backend.layout()), or,
    `reshards` (its optimizer state is layout-free and this backend reads it), by the same backend."""
    saved = json.loads((path / "state.json").read_text()).get("layout")
    saved = saved or {"backend": "torch", "world_size": 1, "expert_parallel": 1}  # before layouts were saved
    if saved == mine:
        return
    if reshards and saved.get("backend") == mine.get("backend"):
        log.info("checkpoint %s: resharding from %s to %s", path, saved, mine)
        return
    why = ("its optimizer state is another backend's" if reshards else
           "its optimizer state is tied to that layout (saved per rank, or by a backend that does not reshard)")
    raise ValueError(f"checkpoint {path} was written by {saved}, this learner is {mine}, and {why}: "
                     "resume with the same backend, ranks and backend.expert_parallel, or use a new "
                     "checkpoint.dir (io.init can start from its policy.safetensors' directory)")


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
    """Remove what a killed process or a full disk left half-written under `root`: checkpoints and files
    (`.tmp-*`, `.trash-step_*`), and a weight store's versions (`.v000123.tmp<pid>`, streamer.transport.weights)."""
    root = Path(root)
    if root.is_dir():
        for p in [*root.glob(".tmp-*"), *root.glob(".trash-step_*"), *root.glob(".v*.tmp*")]:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

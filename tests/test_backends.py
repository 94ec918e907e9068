"""The learner's backend interface: the torch backend's clip by hand, the trainer driven through a backend, and
the import direction (learner.backends uses learner.trainer, never the reverse)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from learner.backends import make_backend
from learner.backends.megatron.backend import check_expert_parallel
from learner.backends.torch import TorchBackend
from learner.config import LearnerConfig
from learner.models.policy import build_policy
from learner.models.value import ValueModel
from learner.train import build_models
from learner.trainer.batching import collate
from learner.trainer.loop import Trainer
from learner.trainer.publish import DirectoryPublisher
from learner.trainer.source import FileSource, write_trajectories
from learner.trainer.step import build_optimizers, prepare, update
from learner.trainer.synthetic import TINY_OVERRIDES, synthetic_trajectories, tiny_model_config
from streamer.wire.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(tmp_path, *overrides: str) -> LearnerConfig:
    return load_config(LearnerConfig, None, TINY_OVERRIDES + [f"checkpoint.dir={tmp_path / 'ck'}", "threads=1",
                                                             "value.warmup_steps=0", "loss.kl_coef=0", *overrides])


class Recording(TorchBackend):
    """The torch backend, recording each call the trainer makes through the interface."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls: list[tuple] = []

    def clip_grads(self, model, max_norm):
        norm = super().clip_grads(model, max_norm)
        self.calls.append(("clip", "policy" if model is self.models.policy else "value", norm))
        return norm

    def export_hf(self, name):
        self.calls.append(("export", name))
        return super().export_hf(name)

    def hf_target(self, name):
        self.calls.append(("target", name))
        return super().hf_target(name)

    def import_hf(self, name, model):
        self.calls.append(("import", name))
        super().import_hf(name, model)

    def layout(self):
        return {"backend": "recording", "world_size": 1, "expert_parallel": 1}


def _recording(cfg) -> Recording:
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.model, seed=cfg.seed).train()
    return Recording(cfg, policy, ValueModel.from_policy(policy, seed=cfg.seed).train())


def _two_params(g1: float, g2: float) -> torch.nn.Module:
    m = torch.nn.Module()
    m.a, m.b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    m.a.grad, m.b.grad = torch.tensor([g1]), torch.tensor([g2])
    return m


def test_torch_backend_clips_to_the_hand_computed_global_norm(tmp_path):
    backend = build_models(make_cfg(tmp_path)).backend
    assert isinstance(backend, TorchBackend)
    m = _two_params(3.0, 4.0)
    assert backend.clip_grads(m, 1.0) == pytest.approx(5.0)  # sqrt(3² + 4²), before clipping
    assert [float(m.a.grad), float(m.b.grad)] == pytest.approx([0.6, 0.8], abs=1e-6)  # scaled by 1 / 5
    m = _two_params(3.0, 4.0)
    assert backend.clip_grads(m, 10.0) == pytest.approx(5.0)  # under the bound: untouched
    assert [float(m.a.grad), float(m.b.grad)] == [3.0, 4.0]


def test_torch_backend_exports_its_live_models_and_names_its_layout(tmp_path):
    models = build_models(make_cfg(tmp_path, "loss.kl_coef=0.1"))
    b = models.backend
    assert b.models is models and b.group is None and b.device == torch.device("cpu")
    assert b.export_hf("policy") is models.policy and b.hf_target("value") is models.value
    assert b.layout() == {"backend": "torch", "world_size": 1, "expert_parallel": 1}
    assert b.hf_config is models.policy.config
    ref = models.reference  # the KL reference: a frozen copy of the initial policy
    assert ref is not models.policy and not any(p.requires_grad for p in ref.parameters())
    other = build_policy(tiny_model_config(), seed=9)
    b.import_hf("policy", other)  # a model from elsewhere: its weights are copied in
    assert torch.equal(models.policy.lm_head.weight, other.lm_head.weight)


def test_update_clips_through_the_backend(tmp_path):
    cfg = make_cfg(tmp_path)
    backend = _recording(cfg)
    batch = collate(synthetic_trajectories(backend.models.policy, 4))
    metrics, applied = update(cfg, backend.models, batch, prepare(cfg, backend.models, batch), train_policy=True)
    assert applied
    assert backend.calls == [("clip", "value", metrics["value_grad_norm"]), ("clip", "policy", metrics["grad_norm"])]


def test_the_trainer_runs_through_the_backend_interface(tmp_path):
    """One training step, its publication and checkpoint, then a resume: every model-side action is a backend
    call, and the checkpoint records the backend's layout."""
    cfg = make_cfg(tmp_path, "batch.max_trajectories=4", "batch.tokens=100000", "max_steps=1")
    backend = _recording(cfg)
    trajs = write_trajectories(tmp_path / "t.jsonl", synthetic_trajectories(backend.models.policy, 4), append=False)
    trainer = Trainer(cfg, backend.models, FileSource(trajs), DirectoryPublisher(tmp_path / "w"))
    assert trainer.run() == 1 and trainer.version == 1
    kinds = [c[:2] for c in backend.calls]
    assert kinds == [("export", "policy"),  # v0 at start
                     ("export", "policy"), ("export", "value"),  # the step-0 checkpoint
                     ("clip", "value"), ("clip", "policy"), ("export", "policy"),  # the step, v1
                     ("export", "policy"), ("export", "value")]  # the final checkpoint
    state = json.loads((tmp_path / "ck" / "step_00000001" / "state.json").read_text())
    assert state["layout"] == backend.layout()

    again = _recording(cfg)
    assert Trainer(cfg, again.models, FileSource(trajs)).resume()
    assert again.calls == [("target", "policy"), ("target", "value"), ("import", "policy"), ("import", "value")]
    assert torch.equal(again.models.policy.lm_head.weight, backend.models.policy.lm_head.weight)
    with pytest.raises(ValueError, match="written by .*recording.* this learner is .*torch"):
        Trainer(cfg, build_models(cfg), FileSource(trajs)).resume()  # another layout: refused


def test_the_trainer_needs_a_backend(tmp_path):
    cfg = make_cfg(tmp_path)
    policy = build_policy(cfg.model, seed=0)
    with pytest.raises(ValueError, match="models.backend is None"):
        Trainer(cfg, build_optimizers(cfg, policy, ValueModel.from_policy(policy)), source=None)


def test_make_backend_picks_by_name(tmp_path):
    cfg = make_cfg(tmp_path)
    policy = build_policy(cfg.model, seed=0)
    assert type(make_backend(cfg, policy, None)) is TorchBackend


def test_expert_parallel_must_divide_the_world_and_the_experts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_expert_parallel(2, 8, "model")
    with pytest.raises(ConfigError, match="expert_parallel: 3 does not divide the world size 4"):
        check_expert_parallel(3, 6, "model")
    with pytest.raises(ConfigError, match="expert_parallel: 4 does not divide the 6 experts of the policy"):
        check_expert_parallel(4, 6, "runs/x")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_trainer_never_imports_a_backend():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.startswith("learner.backends"))
           for p in (ROOT / "learner" / "trainer").rglob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}

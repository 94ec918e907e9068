"""Learner backends: what holds the models the generic trainer (learner.trainer) trains, behind one interface
(`learner.backends.base.Backend`). `torch` (learner.backends.torch) trains the HF models in one process;
`megatron` (learner.backends.megatron) builds the policy and critic as megatron-core GPTModels with MoE expert
parallelism over several ranks. `make_backend` picks one by `cfg.backend.name`; nothing heavy is imported
before it is called.
"""

from __future__ import annotations


def make_backend(cfg, policy, value):
    """The `learner.backends.base.Backend` named by `cfg.backend.name`, holding the HF-format initial policy (and
    critic, or None). Megatron joins the ranks' process group: every rank must call it."""
    if cfg.backend.name == "megatron":
        from learner.backends.megatron.learner import megatron_backend

        return megatron_backend(cfg, policy, value)
    from learner.backends.torch import TorchBackend

    return TorchBackend(cfg, policy, value)

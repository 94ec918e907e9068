"""Learner backends. `torch` is the plain PyTorch path in learner/; `megatron` builds the
policy and critic as megatron-core GPTModels with MoE expert parallelism
(learner.backends.megatron.make_megatron_learner)."""

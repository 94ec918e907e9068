"""Megatron-core backend: GPTModel with MoE and expert parallelism, HF <-> megatron weights.

Import the submodules (model, convert, learner, parallel, grads, cpu_compat); nothing heavy is
imported here so `import learner.backends.megatron` stays cheap.
"""

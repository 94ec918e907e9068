"""Inference engines: `make_engine("torch" | "hf" | "vllm", policy_or_dir, tokenizer)`."""

from learner.engines.base import Engine, Generation, read_state_dict
from learner.engines.factory import ENGINES, make_engine

__all__ = ["Engine", "Generation", "ENGINES", "make_engine", "read_state_dict"]

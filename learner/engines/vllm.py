"""vLLM engine (GPU): batched generation with per-token log-probs, weights reloaded in place.

vLLM is an optional extra (`pip install -e '.[vllm]'`, CUDA only, in its own environment: it pins
its own torch and transformers); this module imports it lazily, so it imports without it.

Log-probs (the contract of `learner.engines.base`): vLLM's default `logprobs_mode="raw_logprobs"`
gives log-softmax of the model's logits before temperature, penalties and top-k/top-p, i.e. the
model distribution at T=1: that is `Generation.logprobs`. `processed_logprobs` would give the
temperature-scaled distribution instead, and only one mode exists per engine, so we keep the raw
mode and derive `sample_logprobs` (T and top-p applied) ourselves: when T != 1 or top_p < 1 each
step asks for the whole vocabulary's raw log-probs (cheap for the character vocabulary) and applies
the sampler's own rule (`learner.engines.sampling.top_p_filter`, the same rule as vLLM's top-p).

The character tokenizer is not an HF tokenizer: the engine runs with `skip_tokenizer_init=True`,
takes token-id prompts, stops on token ids (eos, single-token stop strings); a stop string of
several tokens is cut afterwards with `StopSpec.truncate` (the tokens past it are discarded).

Weights: `load_state_dict` / `load_weights` hand a safetensors file to every vLLM worker through
`LLM.collective_rpc`; a worker extension (`WorkerExtension`, vLLM's `worker_extension_cls`) loads it
with the model's own `load_weights` (HF names, fused into vLLM's layout), then the prefix cache is
reset so no KV block computed with the old weights is reused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from learner.engines.base import Engine, Generation, StopSpec, check_prompts, check_sampling, resolve_stop
from learner.engines.sampling import top_p_filter
from learner.models.tokenizer import Tokenizer

INSTALL_HINT = "pip install -e '.[vllm]' (the `vllm` extra of sao-lab[vllm]) in a separate CUDA environment"
WORKER_EXTENSION = "learner.engines.vllm.WorkerExtension"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class VLLMUnavailable(ImportError, NotImplementedError):
    """vLLM is not installed here. Also a NotImplementedError: what `make_engine('vllm')` raised before
    this engine existed, so callers that caught that keep working."""


def require_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise VLLMUnavailable(
            f"engine 'vllm' needs the optional `vllm` extra, which is not installed here ({e}): {INSTALL_HINT}. "
            "vLLM wheels need CUDA and pin their own torch/transformers; on CPU use --engine torch") from None
    return vllm


@dataclass
class VLLMSettings:
    """Arguments of `vllm.LLM`; `SAO_VLLM="dtype=bfloat16 gpu_memory_utilization=0.5"` overrides them."""

    dtype: str = "auto"  # vLLM's "auto" runs a float32 checkpoint in bfloat16 on GPUs that have it
    gpu_memory_utilization: float = 0.3  # share of the GPU for weights + KV cache (agents may share a GPU)
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True: no CUDA graphs (faster start, slower decoding)
    enable_prefix_caching: bool = True  # group rollouts share their prompt; reset at every weight swap
    seed: int = 0

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMSettings.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.tensor_parallel_size < 1 or self.max_model_len < 0:
            raise ValueError("VLLMSettings: tensor_parallel_size must be >= 1 and max_model_len >= 0")

    def llm_kwargs(self, model_dir: str | Path, vocab_size: int) -> dict[str, Any]:
        kw = {k: v for k, v in asdict(self).items() if not (k == "max_model_len" and v == 0)}
        return {**kw, "model": str(model_dir), "skip_tokenizer_init": True, "logprobs_mode": "raw_logprobs",
                "max_logprobs": vocab_size, "worker_extension_cls": WORKER_EXTENSION}


def settings_from_env(env: dict[str, str] | None = None) -> VLLMSettings:
    from streamer.wire.config import load_config

    text = (os.environ if env is None else env).get("SAO_VLLM", "")
    return load_config(VLLMSettings, None, text.split())


# ----------------------------------------------------------------------------------------- pure pieces

def sampling_kwargs(max_new_tokens: int, temperature: float, top_p: float, stop_ids: Sequence[int],
                    seed: int | None, vocab_size: int) -> dict[str, Any]:
    """`vllm.SamplingParams` arguments of one request."""
    full = temperature > 0 and (temperature != 1.0 or top_p < 1.0)  # sample_logprobs need every token's raw logp
    return {"n": 1, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
            "stop_token_ids": sorted(stop_ids), "logprobs": vocab_size if full else 0, "detokenize": False}


def _position_logprobs(position: Any, vocab_size: int, where: str) -> torch.Tensor:
    """[V] raw log-probs of one step from vLLM's {token: Logprob} (every token must be present)."""
    if position is None or len(position) < vocab_size:
        raise ValueError(f"{where}: vLLM returned {0 if position is None else len(position)} log-probs, "
                         f"need all {vocab_size} to apply temperature/top-p (max_logprobs too small?)")
    out = torch.full((vocab_size,), float("-inf"))
    for tok, lp in position.items():
        if 0 <= tok < vocab_size:
            out[tok] = lp.logprob
    return out


def sample_logprob(position: Any, token: int, temperature: float, top_p: float, vocab_size: int,
                   where: str = "") -> float:
    """log of the probability `token` had under temperature + top-p, from the step's full raw log-probs."""
    raw = _position_logprobs(position, vocab_size, where)
    # raw = logits - logsumexp(logits): a per-row constant, which neither softmax nor top-p sees
    scaled = torch.log_softmax(top_p_filter((raw / temperature)[None], top_p), dim=-1)[0]
    return float(scaled[token])


def to_generation(completion: Any, spec: StopSpec, tokenizer: Tokenizer | None, version: int,
                  temperature: float, top_p: float, vocab_size: int, where: str = "") -> Generation:
    """One vLLM `CompletionOutput` (token_ids, logprobs[i][token].logprob) -> our `Generation`."""
    row = [int(t) for t in completion.token_ids]
    n, reason = spec.truncate(row, tokenizer)
    row = row[:n]
    steps = completion.logprobs
    if steps is None or len(steps) < n:
        raise ValueError(f"{where}: vLLM returned log-probs for {0 if steps is None else len(steps)} of {n} tokens "
                         "(SamplingParams.logprobs must be set)")
    logprobs = []
    for i, t in enumerate(row):
        if t not in steps[i]:
            raise ValueError(f"{where}: token {i} ({t}) has no log-prob in vLLM's output")
        logprobs.append(float(steps[i][t].logprob))
    if temperature == 0:
        sampled = [0.0] * n  # greedy is deterministic
    elif temperature == 1.0 and top_p >= 1.0:
        sampled = list(logprobs)
    else:
        sampled = [sample_logprob(steps[i], t, temperature, top_p, vocab_size, f"{where} token {i}")
                   for i, t in enumerate(row)]
    text = tokenizer.decode(row) if tokenizer is not None else ""
    return Generation(row, logprobs, sampled, reason, version, text)


def check_weight_names(names: Sequence[str], expected: set[str], where: str) -> list[str]:
    """The names to send (a tied lm_head dropped); raises on names the model lacks or is missing."""
    names = [n for n in names if n != "lm_head.weight" or "lm_head.weight" in expected]
    unexpected, missing = sorted(set(names) - expected), sorted(expected - set(names))
    if unexpected or missing:
        raise ValueError(f"{where}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return names


def checkpoint_names(path: str | Path) -> set[str]:
    """Tensor names of a safetensors file (header only), or of a sharded checkpoint's index when `path` (a
    model.safetensors) is absent beside one (a sharded version of the megatron learner)."""
    import json

    from safetensors import safe_open

    index = Path(path).with_name(INDEX_FILE)
    if not Path(path).is_file() and index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


@dataclass(frozen=True)
class ModelInfo:
    """What agents read from `engine.model` (its config: vocabulary, context length); vLLM holds the weights."""

    config: Any


# ----------------------------------------------------------------------------------------- engine

class VLLMEngine(Engine):
    """`make_engine("vllm", policy_or_dir)`; `VLLMEngine(model_dir, tokenizer, settings)` to set vLLM's arguments."""

    def __init__(self, model_dir: str | Path, tokenizer: Tokenizer | None = None,
                 settings: VLLMSettings | None = None, version: int = 0, _owned_dir: str | None = None) -> None:
        vllm = require_vllm()
        from transformers import AutoConfig

        self.model_dir = Path(model_dir)
        self.config = AutoConfig.from_pretrained(self.model_dir)
        self.model = ModelInfo(self.config)
        self.tokenizer = tokenizer
        self.version = version
        self.settings = settings or settings_from_env()
        self.settings.validate()
        self._names = checkpoint_names(self.model_dir / WEIGHTS_FILE)
        self._owned_dir = _owned_dir  # temporary directories this engine removes on close
        self._swap_dir = tempfile.mkdtemp(prefix="sao-vllm-weights-")
        try:
            self.llm = vllm.LLM(**self.settings.llm_kwargs(self.model_dir, self.config.vocab_size))
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_policy(cls, model: Any, tokenizer: Tokenizer | None = None,
                    settings: VLLMSettings | None = None) -> "VLLMEngine":
        """From an in-memory HF policy: saved to a temporary directory vLLM loads from."""
        require_vllm()
        from learner.models.policy import save_policy

        tmp = tempfile.mkdtemp(prefix="sao-vllm-model-")
        save_policy(model, tmp, tokenizer)
        return cls(tmp, tokenizer, settings, _owned_dir=tmp)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 stop: list[str] | list[int] | None = None, seed: int | None = None) -> list[Generation]:
        from vllm import SamplingParams

        V = self.config.vocab_size
        check_prompts(prompts, V)
        check_sampling(max_new_tokens, temperature, top_p)
        spec = resolve_stop(stop, self.tokenizer, self.eos_id)
        stop_ids = spec.token_ids | ({spec.eos_id} - {None})
        # one seed per request: identical prompts of a group must not draw identical samples
        params = [SamplingParams(**sampling_kwargs(max_new_tokens, temperature, top_p, stop_ids,
                                                   None if seed is None else seed + i, V))
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [to_generation(o.outputs[0], spec, self.tokenizer, self.version, temperature, top_p, V,
                              f"vllm prompt {i}") for i, o in enumerate(outs)]

    def load_weights(self, path: str | Path, version: int | None = None) -> None:
        path = Path(path)
        file = path / WEIGHTS_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no safetensors weights there")
        check_weight_names(sorted(checkpoint_names(file)), self._names, str(file))
        self._reload(file)
        self._bump(version)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        from safetensors.torch import save_file

        names = check_weight_names(list(state_dict), self._names, "load_state_dict")
        file = Path(self._swap_dir) / WEIGHTS_FILE
        save_file({n: state_dict[n].detach().to("cpu").contiguous() for n in names}, str(file))
        self._reload(file)
        self._bump(version)

    def _reload(self, file: Path) -> None:
        counts = self.llm.collective_rpc("sao_load_weights", args=(str(file.resolve()),))
        if not counts or min(counts) < 1:
            raise RuntimeError(f"vLLM workers loaded {counts} tensors from {file}")
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stops vLLM's engine and removes the temporary directories."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            del llm
        for d in (self._swap_dir, self._owned_dir):
            if d:
                shutil.rmtree(d, ignore_errors=True)


class WorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`): runs in the worker process, next to the GPU."""

    def sao_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path, device=str(self.device))
        model = self.get_model() if hasattr(self, "get_model") else self.model_runner.model
        model.load_weights(weights=iter(weights.items()))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(weights)

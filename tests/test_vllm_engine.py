"""vLLM engine: pure pieces here (vLLM-shaped outputs -> Generation, stop handling, sampling log-probs,
weight names, settings, the missing-extra error); generation and in-place reload where vLLM and CUDA exist."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file

from learner.engines import make_engine
from learner.engines.base import resolve_stop
from learner.engines.vllm import (
    VLLMSettings,
    VLLMUnavailable,
    WorkerExtension,
    check_weight_names,
    sample_logprob,
    sampling_kwargs,
    settings_from_env,
    to_generation,
)
from learner.models import CharTokenizer, ModelConfig, build_policy, save_policy, token_logprobs
from streamer.wire.config import ConfigError

TOK = CharTokenizer()
HAS_VLLM = importlib.util.find_spec("vllm") is not None
GPU_REASON = "vLLM needs CUDA and the vllm extra"


# vLLM's output shapes (vllm.outputs.CompletionOutput, vllm.logprobs.Logprob), as plain dataclasses
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def step(**lps: float) -> dict[int, Logprob]:
    return {int(k[1:]): Logprob(v) for k, v in lps.items()}


def completion(tokens: list[int], steps: list[dict[int, Logprob]], reason: str = "length") -> CompletionOutput:
    return CompletionOutput(0, "", tokens, None, steps, reason)


# A 4-token distribution p = [0.5, 0.25, 0.125, 0.125]
P4 = [0.5, 0.25, 0.125, 0.125]
FULL4 = {t: Logprob(math.log(p)) for t, p in enumerate(P4)}


def test_missing_vllm_names_the_extra(tmp_path):
    if HAS_VLLM:
        pytest.skip("vllm is installed here: the missing-extra error cannot occur")
    policy = build_policy(ModelConfig(), seed=0)
    with pytest.raises(VLLMUnavailable, match=r"`vllm` extra.*pip install -e '\.\[vllm\]'") as err:
        make_engine("vllm", policy, TOK)
    assert isinstance(err.value, ImportError) and isinstance(err.value, NotImplementedError)
    assert "CUDA" in str(err.value) and "sao-lab[vllm]" in str(err.value)
    save_policy(policy, tmp_path / "p", TOK)
    with pytest.raises(VLLMUnavailable):  # from a directory too, and nothing left behind to clean
        make_engine("vllm", tmp_path / "p")


def test_to_generation_logprobs_and_eos_truncation():
    spec = resolve_stop(None, TOK, TOK.eos_id)
    a, b = TOK.encode("ab")
    out = completion([a, b, TOK.eos_id], [step(**{f"t{a}": -0.1}), step(**{f"t{b}": -0.2}),
                                          step(**{f"t{TOK.eos_id}": -0.3})], "stop")
    g = to_generation(out, spec, TOK, 7, 1.0, 1.0, TOK.vocab_size)
    assert g.token_ids == [a, b, TOK.eos_id] and g.finish_reason == "eos" and g.version == 7
    assert g.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert g.sample_logprobs == g.logprobs  # T = 1, no top-p: the same distribution
    assert g.text == "ab"  # specials skipped


def test_to_generation_multi_token_stop_string_cuts_the_rest():
    # "==" is two tokens, so vLLM cannot stop on it by id: the tokens after it are discarded here
    spec = resolve_stop(["=="], TOK, TOK.eos_id)
    ids = TOK.encode("1==2x")
    out = completion(ids, [step(**{f"t{t}": -0.5 - i}) for i, t in enumerate(ids)])
    g = to_generation(out, spec, TOK, 0, 0.0, 1.0, TOK.vocab_size)
    assert g.text == "1==" and g.finish_reason == "stop"
    assert g.logprobs == pytest.approx([-0.5, -1.5, -2.5])
    assert g.sample_logprobs == [0.0, 0.0, 0.0]  # greedy: deterministic


def test_to_generation_length_and_single_token_stop():
    spec = resolve_stop(["<call>"], TOK, TOK.eos_id)
    call = TOK.encode("<call>")[0]
    assert spec.token_ids == frozenset({call})
    ids = TOK.encode("ab")
    g = to_generation(completion(ids, [step(**{f"t{t}": -1.0}) for t in ids]), spec, TOK, 0, 1.0, 1.0, TOK.vocab_size)
    assert g.finish_reason == "length" and len(g.token_ids) == 2
    ids = TOK.encode("a<call>")
    g = to_generation(completion(ids, [step(**{f"t{t}": -1.0}) for t in ids], "stop"), spec, TOK, 0, 1.0, 1.0,
                      TOK.vocab_size)
    assert g.finish_reason == "stop" and g.token_ids == ids


def test_sample_logprob_temperature_and_top_p_by_hand():
    # T = 0.5: p_T ∝ p^2 = [0.25, 0.0625, 0.015625, 0.015625], sum 0.34375 -> p_T(0) = 0.25 / 0.34375 = 8/11
    assert sample_logprob(FULL4, 0, 0.5, 1.0, 4) == pytest.approx(math.log(8 / 11), abs=1e-6)
    # T = 2: p_T ∝ sqrt(p) = [0.7071, 0.5, 0.3536, 0.3536], sum 1.9142 -> p_T(1) = 0.5 / 1.9142
    z = sum(math.sqrt(p) for p in P4)
    assert sample_logprob(FULL4, 1, 2.0, 1.0, 4) == pytest.approx(math.log(0.5 / z), abs=1e-6)
    # top_p = 0.7 at T = 1: ascending [0.125, 0.125, 0.25, 0.5], cumsum [0.125, 0.25, 0.5, 1]; tokens with
    # cumsum <= 0.3 are dropped (tokens 2, 3), the rest renormalised: p(1) = 0.25 / 0.75 = 1/3
    assert sample_logprob(FULL4, 1, 1.0, 0.7, 4) == pytest.approx(math.log(1 / 3), abs=1e-6)
    assert sample_logprob(FULL4, 2, 1.0, 0.7, 4) == float("-inf")


def test_to_generation_temperature_uses_the_full_distribution():
    spec = resolve_stop(None, None, None)
    g = to_generation(completion([0, 1], [dict(FULL4), dict(FULL4)]), spec, None, 0, 0.5, 1.0, 4)
    assert g.logprobs == pytest.approx([math.log(0.5), math.log(0.25)])  # raw: the model at T = 1
    # p_T(1) = 0.0625 / 0.34375 = 2/11 (see the derivation above)
    assert g.sample_logprobs == pytest.approx([math.log(8 / 11), math.log(2 / 11)], abs=1e-6)
    assert g.text == ""  # no tokenizer


def test_to_generation_refuses_incomplete_logprobs():
    spec = resolve_stop(None, None, None)
    with pytest.raises(ValueError, match="need all 4"):  # temperature needs every token's log-prob
        to_generation(completion([0], [{0: Logprob(-0.7)}]), spec, None, 0, 0.5, 1.0, 4, "prompt 3")
    with pytest.raises(ValueError, match="prompt 2: vLLM returned log-probs for 0 of 1"):
        to_generation(completion([0], None), spec, None, 0, 1.0, 1.0, 4, "prompt 2")
    with pytest.raises(ValueError, match=r"token 0 \(1\) has no log-prob"):
        to_generation(completion([1], [{0: Logprob(-0.7)}]), spec, None, 0, 1.0, 1.0, 4)


def test_sampling_kwargs_ask_for_the_whole_vocab_only_when_needed():
    kw = sampling_kwargs(16, 1.0, 1.0, {5, 2}, 3, 68)
    assert kw["logprobs"] == 0 and kw["stop_token_ids"] == [2, 5] and kw["seed"] == 3 and kw["max_tokens"] == 16
    assert kw["detokenize"] is False  # skip_tokenizer_init: nothing to detokenize with
    assert sampling_kwargs(16, 0.0, 0.9, set(), None, 68)["logprobs"] == 0  # greedy: sample_logprobs are 0
    assert sampling_kwargs(16, 0.7, 1.0, set(), None, 68)["logprobs"] == 68
    assert sampling_kwargs(16, 1.0, 0.9, set(), None, 68)["logprobs"] == 68


def test_weight_names_checked_tied_head_dropped():
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    got = check_weight_names(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"], expected, "sd")
    assert got == ["model.embed_tokens.weight", "model.norm.weight"]
    with pytest.raises(ValueError, match=r"sd: weights do not match the model: missing \['model.norm.weight'\], "
                                         r"unexpected \['model.extra'\]"):
        check_weight_names(["model.embed_tokens.weight", "model.extra"], expected, "sd")


def test_settings_from_env_and_llm_arguments():
    s = settings_from_env({"SAO_VLLM": "dtype=float32 gpu_memory_utilization=0.5 enforce_eager=true"})
    assert (s.dtype, s.gpu_memory_utilization, s.enforce_eager) == ("float32", 0.5, True)
    kw = s.llm_kwargs("/m", 68)
    assert kw["skip_tokenizer_init"] is True and kw["logprobs_mode"] == "raw_logprobs" and kw["max_logprobs"] == 68
    assert kw["worker_extension_cls"] == "learner.engines.vllm.WorkerExtension" and "max_model_len" not in kw
    assert VLLMSettings(max_model_len=256).llm_kwargs("/m", 68)["max_model_len"] == 256
    with pytest.raises(ConfigError, match="gpu_memory_util"):
        settings_from_env({"SAO_VLLM": "gpu_memory_util=0.5"})
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5: must be in \(0, 1\]"):
        settings_from_env({"SAO_VLLM": "gpu_memory_utilization=1.5"})


def test_worker_extension_sends_every_tensor_of_the_file(tmp_path):
    # The worker side of a reload, on a stand-in for vLLM's worker (a device and a model with load_weights)
    class Model:
        def load_weights(self, weights):
            self.got = dict(weights)
            return set(self.got)

    class Worker(WorkerExtension):
        device = "cpu"

        def __init__(self):
            self.model = Model()

        def get_model(self):
            return self.model

    tensors = {"model.norm.weight": torch.arange(3.0), "model.embed_tokens.weight": torch.ones(2, 3)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    w = Worker()
    assert w.sao_load_weights(str(tmp_path / "w.safetensors")) == 2
    assert set(w.model.got) == set(tensors) and torch.equal(w.model.got["model.norm.weight"], torch.arange(3.0))


# ----------------------------------------------------------------------------------------- GPU

def _gpu_engine(policy, tmp_path):
    pytest.importorskip("vllm", reason=GPU_REASON)
    if not torch.cuda.is_available():
        pytest.skip(GPU_REASON)
    from learner.engines.vllm import VLLMEngine

    save_policy(policy, tmp_path / "p", TOK)
    # float32 so that vLLM's log-probs can be held to the learner's to 1e-3 (bf16 mismatch: bench/logprob_mismatch.py)
    return VLLMEngine(tmp_path / "p", TOK,
                      VLLMSettings(dtype="float32", enforce_eager=True, gpu_memory_utilization=0.2))


def _learner_logprobs(policy, prompt: list[int], gen: list[int]) -> list[float]:
    ids = torch.tensor([prompt + gen])
    return token_logprobs(policy, ids)[0, len(prompt):].tolist()


@pytest.mark.gpu
def test_vllm_generates_learner_logprobs_and_reloads_in_place(tmp_path):
    policy, other = build_policy(ModelConfig(), seed=0), build_policy(ModelConfig(), seed=1)
    engine = _gpu_engine(policy, tmp_path)
    try:
        prompts = [TOK.encode("12+7=", bos=True), TOK.encode("abc", bos=True)]
        gens = engine.generate(prompts, 12, temperature=1.0, seed=0)
        for p, g in zip(prompts, gens):
            assert g.version == 0 and len(g.token_ids) >= 1 and g.sample_logprobs == g.logprobs
            assert g.logprobs == pytest.approx(_learner_logprobs(policy, p, g.token_ids), abs=1e-3)
        warm = engine.generate(prompts, 12, temperature=0.7, top_p=0.9, seed=1)
        assert any(g.sample_logprobs != g.logprobs for g in warm)
        engine.load_state_dict(other.state_dict())  # in place: version 1, the new weights' log-probs
        g = engine.generate(prompts[:1], 12, temperature=0)[0]
        assert engine.version == 1 and g.version == 1 and g.sample_logprobs == [0.0] * len(g.token_ids)
        assert g.logprobs == pytest.approx(_learner_logprobs(other, prompts[0], g.token_ids), abs=1e-3)
        save_policy(policy, tmp_path / "back")
        engine.load_weights(tmp_path / "back", version=5)
        g = engine.generate(prompts[:1], 12, temperature=0)[0]
        assert engine.version == 5
        assert g.logprobs == pytest.approx(_learner_logprobs(policy, prompts[0], g.token_ids), abs=1e-3)
        with pytest.raises(ValueError, match="missing"):
            engine.load_state_dict({"model.norm.weight": torch.ones(128)})
        assert engine.version == 5
    finally:
        engine.close()


@pytest.mark.gpu
def test_vllm_stops_and_group_seeds(tmp_path):
    engine = _gpu_engine(build_policy(ModelConfig(), seed=0), tmp_path)
    try:
        prompt = TOK.encode("ab", bos=True)
        group = engine.generate([prompt] * 4, 16, temperature=1.0, seed=3)
        assert len({tuple(g.token_ids) for g in group}) > 1  # one seed per request: a group is not 4 copies
        again = engine.generate([prompt] * 4, 16, temperature=1.0, seed=3)
        assert [g.token_ids for g in again] == [g.token_ids for g in group]
        for g in engine.generate([prompt] * 8, 24, temperature=1.0, stop=["a"], seed=0):
            if g.finish_reason == "stop":
                assert TOK.decode(g.token_ids).endswith("a")
            assert g.finish_reason != "length" or len(g.token_ids) == 24
    finally:
        engine.close()

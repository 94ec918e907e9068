"""Bring your own model: any HF causal LM with its own tokenizer and chat template, through engines, rollouts,
value model, learner scoring, publishing and prompt validation. The models are built here (`learner.models.toy`:
a Qwen3 dense and a GLM-4-MoE of real architecture, random init, a BPE tokenizer trained locally), no hub."""

from __future__ import annotations

import pytest
import torch

from learner.engines import make_engine
from learner.models import HFTokenizer, ValueModel, load_policy, load_tokenizer, token_logprobs
from learner.models.toy import ARCHS, IM_END, build_toy_model
from learner.trainer.publish import DirectoryPublisher
from simulator.records import EMBEDDED, RowError, message_from_row, prompt_rule
from simulator.warmstart import scenario_texts
from streamer.agent.rollouts import run_tasks
from streamer.wire.schema import Task
from streamer.wire.settings import AgentSettings

TEXTS = scenario_texts(300) + ["Quelle est la capitale ? Réponds en un mot.", "数学: 2 + 2 = 4", "Résumé du ticket"]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory):
    return build_toy_model(request.param, TEXTS, tmp_path_factory.mktemp(request.param), vocab_size=400)


def test_toy_models_are_real_architectures_with_a_chat_template(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ in ("Qwen3ForCausalLM", "Glm4MoeForCausalLM")
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert len(hf) == 400 and hf.eos_token == IM_END
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, HFTokenizer) and tok.chat
    text = "Réponds: 数学 2+2?"
    assert tok.decode(tok.encode(text)) == text  # byte-level BPE: no alphabet, nothing unknown
    assert tok.decode(tok.encode_prompt(text), skip_special=False) == (
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.decode(tok.encode_prompt("ignored", chat), skip_special=False).startswith("<|im_start|>system\nbe brief")
    assert not HFTokenizer.load(model_dir, chat=False).chat


def test_generic_sampler_matches_transformers_generate_and_the_learner_scores_it(model_dir):
    tok = load_tokenizer(model_dir)
    prompts = [tok.encode_prompt(p) for p in ("a+b=?", "f:abc=", "Quelle est la capitale ?")]
    ours, ref = make_engine("torch", model_dir), make_engine("hf", model_dir)
    assert type(ours).__name__ == "CachedSampler"
    a = ours.generate(prompts, 10, temperature=0.0, seed=0)
    b = ref.generate(prompts, 10, temperature=0.0, seed=0)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    # sampled at T=1: the learner's log-probs of the same tokens equal the engine's (ratio 1 on-policy)
    policy = load_policy(model_dir)
    for p, g in zip(prompts, ours.generate(prompts, 8, temperature=1.0, seed=3)):
        ids = torch.tensor([p + g.token_ids])
        lp = token_logprobs(policy, ids)[0, len(p):]
        assert lp.tolist() == pytest.approx(g.logprobs, abs=1e-4)


def test_rollouts_and_value_model_on_the_model(model_dir, tmp_path):
    tok = load_tokenizer(model_dir)
    tasks = [Task(task_id=f"t{i}", family="ops", concept="exact", prompt=f"Ticket {i}: répondez « oui »",
                  answer="oui", spec={"verifier": "exact", "params": {}, "tags": {"source": "ops"}})
             for i in range(3)]
    s = AgentSettings(concurrency=3, max_new_tokens=6, seed=1)
    trajs = [t[0] for t in run_tasks(make_engine("torch", model_dir, tok), tok, tasks, s)]
    for t, task in zip(trajs, tasks):
        prompt = tok.encode_prompt(task.prompt)
        assert t.tokens[:len(prompt)] == prompt and t.prompt_len == len(prompt)
        assert sum(t.loss_mask) == len(t.tokens) - len(prompt) >= 1
    policy = load_policy(model_dir)
    vm = ValueModel.from_policy(policy, seed=0)
    backbone = policy.base_model.state_dict()
    assert all(torch.equal(v, backbone[k]) for k, v in vm.backbone.state_dict().items())
    again = ValueModel.load(vm.save(tmp_path / "value"))
    ids = torch.tensor([trajs[0].tokens])
    assert torch.equal(vm(ids), again(ids)) and vm(ids).shape == ids.shape


def test_published_versions_carry_the_model_tokenizer(model_dir, tmp_path):
    tok = load_tokenizer(model_dir)
    pv = DirectoryPublisher(tmp_path / "w", tokenizer=tok).publish(load_policy(model_dir), 1, 1)
    again = load_tokenizer(pv.uri)
    assert isinstance(again, HFTokenizer) and again.chat
    assert again.encode_prompt("hello") == tok.encode_prompt("hello")
    assert type(load_policy(pv.uri)).__name__ == type(load_policy(model_dir)).__name__


def test_prompts_are_checked_against_the_served_model(model_dir):
    row = {"prompt": "Quelle est la capitale de la France ? " * 8, "reference": "Paris", "verifier": "exact",
           "tags": {"source": "geo"}}
    with pytest.raises(RowError, match="alphabet") as e:  # the embedded character model cannot read it
        message_from_row(row, rule=EMBEDDED)
    assert e.value.field == "prompt"
    rule = prompt_rule(model_dir, load_tokenizer)
    assert message_from_row(row, rule=rule).prompt == row["prompt"]  # 304 characters, not ASCII: fine
    with pytest.raises(RowError, match="over the model's context of 1024") as e:
        message_from_row({**row, "prompt": "réponse " * 1200}, rule=rule)
    assert e.value.field == "prompt"
    assert prompt_rule(None) is EMBEDDED
    with pytest.raises(ValueError, match="load_tokenizer"):  # the simulator reads no tokenizer by itself
        prompt_rule(model_dir)

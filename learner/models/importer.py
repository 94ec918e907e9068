"""`sao import SRC OUT`: a GGUF file or an HF model directory made into the model directory `sao up --model` takes.

The directory is saved with `save_pretrained` (safetensors, float32), its tokenizer and chat template beside it.
The end token is checked, not trusted: the token that ends an assistant turn in the chat template (ChatML's
`<|im_end|>`) becomes the tokenizer's eos_token and the generation config's eos_token_id (a GGUF read by transformers
can name another one: SmolLM2's reports `<|im_start|>`, and its answers then never end). Then the import proves it:
the saved directory, reloaded as the agents load it (`load_tokenizer`), answers a short chat greedily, and the answer
must end with that token before `--max-new-tokens`; otherwise the import fails and says so.

    sao import runs/SmolLM2-135M-Instruct.Q4_1.gguf runs/models/smollm2   # needs the `import` extra (gguf)
    sao import path/to/hf-checkpoint runs/models/mine [--chat-template FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

SENTINEL = "SAO-IMPORT-ANSWER"  # an assistant message's text, to find what the template writes after it
CHECK_CHAT = [{"role": "user", "content": "What is 2 + 3? Answer with one number."}]


class ImportFailed(ValueError):
    """The source cannot become a model directory whose answers end; the message says why and what to do."""


@dataclass
class Imported:
    out: Path
    end_token: str
    fixes: list[str] = field(default_factory=list)
    answer: str = ""
    answer_tokens: int = 0
    max_new_tokens: int = 64
    seconds: float = 0.0


def gguf_location(src: Path) -> tuple[Path, str | None]:
    """(directory, gguf file name or None): a .gguf file, or a directory with one .gguf and no config.json."""
    if src.is_file():
        if src.suffix != ".gguf":
            raise ImportFailed(f"{src}: a file must be a .gguf model (or give an HF model directory)")
        return src.parent, src.name
    if not src.is_dir():
        raise ImportFailed(f"{src}: no such file or directory")
    if (src / "config.json").is_file():
        return src, None
    ggufs = sorted(src.glob("*.gguf"))
    if len(ggufs) != 1:
        raise ImportFailed(f"{src}: neither an HF model directory (config.json) nor a directory with one .gguf file "
                           f"({len(ggufs)} found); name the file")
    return src, ggufs[0].name


def load_source(src: Path):
    """(model, tokenizer) of a GGUF file (dequantized to float32) or an HF directory; no hub is contacted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, gguf = gguf_location(src)
    kw = {"gguf_file": gguf} if gguf else {}
    if gguf:
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if missing:  # transformers reads GGUF files with both
            raise ImportFailed(f"{src}: reading a GGUF file needs {' and '.join(missing)}: pip install "
                               f"'sao-lab[import]'")
    tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(str(where), local_files_only=True, dtype=torch.float32, **kw)
    return model.eval(), tok


def turn_end_token(tok) -> str:
    """The special token the chat template writes right after an assistant message (`<|im_end|>` for ChatML)."""
    if not getattr(tok, "chat_template", None):
        raise ImportFailed("the tokenizer has no chat template: give one with --chat-template FILE (a Jinja template)")
    chat = [*CHECK_CHAT, {"role": "assistant", "content": SENTINEL}]
    text = tok.apply_chat_template(chat, tokenize=False)
    if SENTINEL not in text:
        raise ImportFailed("the chat template does not write the assistant's message; cannot find its end token")
    after = text.split(SENTINEL, 1)[1]
    specials = sorted({*tok.all_special_tokens, *(t.content for t in tok.added_tokens_decoder.values())},
                      key=len, reverse=True)
    for token in specials:
        if token and after.startswith(token):
            return token
    raise ImportFailed(f"the chat template ends an assistant turn with {after[:40]!r}, not with a special token: "
                       f"the model would have no token to end an answer with (give a template that ends turns with "
                       f"one, --chat-template FILE)")


def fix_end_token(model, tok, end: str) -> list[str]:
    """Make `end` the tokenizer's eos and the model's (config and generation config); what changed, in words."""
    end_id = tok.convert_tokens_to_ids(end)
    fixes = []
    if tok.eos_token != end:
        fixes.append(f"eos_token {tok.eos_token!r} -> {end!r} (the token that ends an assistant turn in the template)")
        tok.eos_token = end
    if tok.pad_token is None:
        fixes.append(f"pad_token None -> {end!r}")
        tok.pad_token = end
    gen = model.generation_config
    if gen.eos_token_id != end_id:
        fixes.append(f"generation_config.eos_token_id {gen.eos_token_id} -> {end_id}")
        gen.eos_token_id = end_id
    if model.config.eos_token_id != end_id:
        fixes.append(f"config.eos_token_id {model.config.eos_token_id} -> {end_id}")
        model.config.eos_token_id = end_id
    if gen.pad_token_id is None:
        gen.pad_token_id = tok.pad_token_id
    return fixes


def check_answer_ends(out: Path, max_new_tokens: int) -> tuple[str, int]:
    """Reload `out` as the agents do and answer CHECK_CHAT greedily; (answer, its tokens) when it ended in time."""
    from transformers import AutoModelForCausalLM

    from learner.models.tokenizer import load_tokenizer

    tok = load_tokenizer(out)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()
    prompt = torch.tensor([tok.encode_prompt("", CHECK_CHAT)])
    with torch.no_grad():
        ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)[0, prompt.shape[1]:]
    answer = tok.decode(ids.tolist(), skip_special=False)
    if tok.eos_id not in ids.tolist():
        raise ImportFailed(f"{out}: a greedy answer to {CHECK_CHAT[0]['content']!r} did not end within "
                           f"{max_new_tokens} tokens (no {tok.tok.eos_token!r}): {answer[:120]!r}... The model would "
                           f"answer every task up to the token limit; check the end token or the model")
    return answer, ids.tolist().index(tok.eos_id) + 1


def import_model(src: str | Path, out: str | Path, max_new_tokens: int = 64,
                 chat_template: str | None = None) -> Imported:
    """Load `src`, fix and save to `out`, prove that a chat answer ends (`ImportFailed` otherwise)."""
    t0 = time.monotonic()
    src, out = Path(src), Path(out)
    model, tok = load_source(src)
    fixes = []
    if chat_template is not None:
        tok.chat_template = chat_template
        fixes.append("chat template: given with --chat-template")
    end = turn_end_token(tok)
    fixes += fix_end_token(model, tok, end)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(str(out))
    answer, n = check_answer_ends(out, max_new_tokens)
    return Imported(out, end, fixes, answer, n, max_new_tokens, time.monotonic() - t0)


def report(r: Imported) -> str:
    lines = [f"imported to {r.out} in {r.seconds:.1f}s; end token {r.end_token!r}"]
    lines += [f"  fixed: {f}" for f in r.fixes] or ["  fixed: nothing (the end token was right)"]
    lines.append(f"  checked: a greedy chat answer ended after {r.answer_tokens} of at most {r.max_new_tokens} "
                 f"tokens: {r.answer!r}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sao import", description=__doc__.splitlines()[0])
    p.add_argument("src", help="a .gguf file, or an HF model directory (config.json, weights, tokenizer)")
    p.add_argument("out", help="the model directory to write (what `sao up --model` takes)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="the check's answer must end within this many")
    p.add_argument("--chat-template", help="a Jinja chat template file, for a model without one (or to replace it)")
    a = p.parse_args(argv)
    template = Path(a.chat_template).read_text() if a.chat_template else None
    try:
        print(report(import_model(a.src, a.out, a.max_new_tokens, template)))
    except ImportFailed as e:
        print(f"sao import: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

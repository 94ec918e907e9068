"""Small Hugging Face models of real architectures, built here from a config: no hub, no download.

`build_toy_model(arch, texts, out)` trains a byte-level BPE tokenizer on `texts` with the `tokenizers`
library, gives it a ChatML chat template (`<|im_start|>role ... <|im_end|>`, the end of a turn is
the end-of-sequence token), initialises a `Qwen3ForCausalLM` (dense) or a `Glm4MoeForCausalLM`
(shared expert, sigmoid router, a first dense layer, attention bias, partial rotary) of a few
hundred thousand parameters at random and saves both with `save_pretrained`. The result is the
directory a user would pass as `--model`: the tests and the "bring your own model" example run the
pipeline on it exactly as on a downloaded checkpoint.

    sao toy-model --arch qwen3 --out runs/models/qwen3-toy [--stream FILE] [--vocab 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch

ARCHS = ("qwen3", "glm4_moe")
IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` (any text encodes, nothing is unknown) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    return tok


def toy_config(arch: str, tok, hidden: int = 64, layers: int = 2):
    """The HF config of a toy `arch` model over `tok`'s vocabulary (float32)."""
    heads = max(4, hidden // 64)  # head_dim 64 from hidden 256 up (what GPU attention kernels expect)
    common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads // 2, head_dim=hidden // heads, max_position_embeddings=1024,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, dtype="float32")
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, intermediate_size=2 * hidden, tie_word_embeddings=True)
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**common, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
                             first_k_dense_replace=1, n_routed_experts=4,
                             num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                             partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
                             tie_word_embeddings=False)
    raise ValueError(f"toy model: unknown arch '{arch}' (known: {', '.join(ARCHS)})")


def build_toy_model(arch: str, texts: Iterable[str], out: str | Path, vocab_size: int = 512, hidden: int = 64,
                    layers: int = 2, seed: int = 0) -> Path:
    """Train the tokenizer, initialise the model at random (seeded) and save both under `out`."""
    from transformers import AutoModelForCausalLM

    tok = train_tokenizer(texts, vocab_size)
    config = toy_config(arch, tok, hidden, layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def stream_texts(path: str | Path) -> list[str]:
    """Prompts, chat messages and references of a recorded stream (JSONL), to train a tokenizer on."""
    texts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts += [row.get("prompt") or "", str(row.get("reference", ""))]
            texts += [m.get("content", "") for m in row.get("messages") or [] if isinstance(m, dict)]
    return [t for t in texts if t]


def main(argv: list[str], default_texts: Callable[[], list[str]] | None = None) -> int:
    """`default_texts()`: the texts to train the tokenizer on without --stream (`sao toy-model` passes the
    simulator's `simulator.warmstart.scenario_texts`; learner.models does not import the simulator)."""
    p = argparse.ArgumentParser(prog="sao toy-model", description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=ARCHS, default="qwen3")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--stream", help="train the tokenizer on this JSONL stream's texts (default: the simulator's)")
    p.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.stream and default_texts is None:
        p.error("--stream FILE is needed when no default texts are handed in (`sao toy-model` hands the simulator's)")
    texts = stream_texts(a.stream) if a.stream else default_texts()
    out = build_toy_model(a.arch, texts, a.out, a.vocab, a.hidden, a.layers, a.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

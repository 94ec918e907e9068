"""Tokenizers the agents and the learner use: the embedded character tokenizer, or a model's own.

`CharTokenizer` is the tiny model's, built locally (no hub): every simulator prompt, answer and
observation is written in ALPHABET (`streamer.wire.alphabet`, the simulator's too); the markup strings in
MARKUP are single tokens so that a tool call is a short, learnable sequence. `HFTokenizer` puts any transformers
tokenizer behind the same small interface (encode, decode, encode_prompt, the special ids, save), applying the
model's chat template to prompts when it has one. `load_tokenizer(dir)` picks the one a model directory holds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

from streamer.wire.alphabet import ALPHABET, MARKUP

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_MARKUP_RE = re.compile("(" + "|".join(map(re.escape, MARKUP)) + ")")


class Tokenizer(Protocol):
    """What agents, engines and the learner ask of a tokenizer (`CharTokenizer`, `HFTokenizer`)."""

    eos_id: int | None
    pad_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, bos: bool = False) -> list[int]: ...

    def encode_prompt(self, text: str, messages: list[dict] | None = None) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...

    def save(self, path: str | Path) -> None: ...


class CharTokenizer:
    def __init__(self) -> None:
        self.id_to_token = SPECIALS + list(MARKUP) + list(ALPHABET)
        self.token_to_id = {t: i for i, t in enumerate(self.id_to_token)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = [self.bos_id] if bos else []
        get = self.token_to_id.get
        for i, part in enumerate(_MARKUP_RE.split(text)):  # markup wins over its characters; odd parts are markup
            ids += [self.token_to_id[part]] if i % 2 else [get(c, self.unk_id) for c in part]
        return ids

    def encode_prompt(self, text: str, messages: list[dict] | None = None) -> list[int]:
        """<bos> and the prompt text (no chat template: `messages` are already rendered into `text`)."""
        return self.encode(text, bos=True)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        out = []
        for i in ids:
            if i < len(SPECIALS) and skip_special:
                continue
            out.append(self.id_to_token[i] if 0 <= i < self.vocab_size else "<unk>")
        return "".join(out)

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sao_tokenizer.json").write_text(json.dumps({"vocab": self.id_to_token}))

    @classmethod
    def load(cls, path: str | Path) -> "CharTokenizer":
        tok = cls()
        saved = json.loads((Path(path) / "sao_tokenizer.json").read_text())["vocab"]
        if saved != tok.id_to_token:
            raise ValueError(f"{path}/sao_tokenizer.json: vocabulary differs from this build's CharTokenizer")
        return tok


def in_alphabet(text: str) -> bool:
    """True if `text` encodes without <unk> (markup included)."""
    return UNK_ID not in CharTokenizer().encode(text)


def hf_tokenizer(tok: CharTokenizer | None = None):
    """The same vocabulary as a transformers `PreTrainedTokenizerFast` (ids, markup and decoding identical), so a
    saved policy directory also loads with `AutoTokenizer` (vLLM, HF tooling). Built locally, no hub."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tok or CharTokenizer()
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tok.id_to_token)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    core.decoder = decoders.Fuse()  # concatenate, no spaces between pieces
    core.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIALS])
    core.add_tokens([AddedToken(m, normalized=False, special=False) for m in MARKUP])  # matched before characters
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def save_hf_tokenizer(tok: CharTokenizer, path: str | Path) -> None:
    """Write tokenizer.json and its configs next to sao_tokenizer.json."""
    hf_tokenizer(tok).save_pretrained(str(path))


class HFTokenizer:
    """A transformers tokenizer with CharTokenizer's interface. Prompts go through the chat template when the
    tokenizer has one (`chat=True`): one user message, or the task's own chat messages, then the generation
    prompt; without a template a prompt is <bos> (if the model has one) and the text."""

    def __init__(self, tok, chat: bool = True) -> None:
        self.tok = tok
        self.eos_id = tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer {tok.name_or_path!r} has no eos_token: generation could never end")
        self.bos_id = tok.bos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.unk_id = tok.unk_token_id
        self.chat = chat and bool(getattr(tok, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def encode_prompt(self, text: str, messages: list[dict] | None = None) -> list[int]:
        if not self.chat:
            return self.encode(text, bos=True)
        chat = messages or [{"role": "user", "content": text}]
        return list(self.tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def save(self, path: str | Path) -> None:
        self.tok.save_pretrained(str(path))

    @classmethod
    def load(cls, path: str | Path, chat: bool = True) -> "HFTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), chat)


def load_tokenizer(path: str | Path, chat: bool = True) -> CharTokenizer | HFTokenizer:
    """The tokenizer a model directory holds: the embedded one (`sao_tokenizer.json`), else its HF tokenizer."""
    if (Path(path) / "sao_tokenizer.json").is_file():
        return CharTokenizer.load(path)
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"{path}: no tokenizer (neither sao_tokenizer.json nor an HF tokenizer's files)")
    return HFTokenizer.load(path, chat)

"""Character tokenizer for the simulator's alphabet plus tool-call markup, built locally (no hub).

Every simulator prompt, answer and observation is written in ALPHABET; the markup strings in
MARKUP are single tokens so that a tool call is a short, learnable sequence.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
MARKUP = ["<call>", "</call>", "<obs>", "</obs>"]
ALPHABET = string.ascii_lowercase + string.digits + " +-*/%=()[]{}<>:;,.?!_|#@'\"&^~$\n"

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_MARKUP_RE = re.compile("(" + "|".join(map(re.escape, MARKUP)) + ")")


class CharTokenizer:
    def __init__(self) -> None:
        self.id_to_token = SPECIALS + MARKUP + list(ALPHABET)
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

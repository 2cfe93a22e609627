"""Tokenizers for ``hetctl data prepare``: a local Hugging Face tokenizer folder, or UTF-8 bytes.

No hub downloads: the Hugging Face tokenizer is read from its ``tokenizer.json``
with the ``tokenizers`` library (the same file ``transformers`` loads). Every
document gets the tokenizer's end-of-document id appended, as Megatron's
``preprocess_data.py --append-eod`` does, so documents stay apart once the
trainer concatenates them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hetctl.errors import ConfigError

BYTES = "bytes"
BYTE_EOD = 256  # the bytes tokenizer: ids 0..255 are the bytes, 256 ends a document

# Names models use for their end-of-text token, tried when tokenizer_config.json names none.
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


@dataclass(frozen=True)
class Tokenizer:
    """A text → ids function with its vocabulary size and end-of-document id.

    Attributes:
        name: ``bytes``, or the tokenizer file's path (recorded in the report).
        vocab_size: ids run from 0 to ``vocab_size - 1``.
        eod: the id appended to every document.
        encode_batch: texts → one id list per text (no special tokens added).
    """

    name: str
    vocab_size: int
    eod: int
    encode_batch: Callable[[list[str]], list[list[int]]]


def byte_tokenizer() -> Tokenizer:
    """UTF-8 bytes: 256 byte ids plus the end-of-document id 256 (vocabulary 257)."""
    return Tokenizer(BYTES, 257, BYTE_EOD, lambda texts: [list(t.encode("utf-8")) for t in texts])


def load_tokenizer(spec: str) -> Tokenizer:
    """``bytes``, or a folder holding ``tokenizer.json`` (or that file itself).

    Raises:
        ConfigError: no such folder or file, ``tokenizers`` missing, a file it cannot parse, or no
            end-of-document token found.
    """
    if spec == BYTES:
        return byte_tokenizer()
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{file}: no such tokenizer file (--tokenizer {spec})",
                          "pass a Hugging Face tokenizer folder that holds tokenizer.json, or `bytes`")
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ConfigError("--tokenizer PATH needs the `tokenizers` library",
                          "pip install tokenizers (or pass --tokenizer bytes)") from None
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a bad file
        raise ConfigError(f"{file}: not a tokenizers file: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    eod = _eod_id(tok, file.parent / "tokenizer_config.json")
    if eod is None:
        raise ConfigError(f"{file}: no end-of-document token (eos_token in tokenizer_config.json, or one of "
                          f"{', '.join(EOD_NAMES)})", "add eos_token to the folder's tokenizer_config.json")

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(str(file), int(tok.get_vocab_size(with_added_tokens=True)), eod, encode_batch)


def _eod_id(tok, config: Path) -> int | None:
    """The id of ``eos_token`` from tokenizer_config.json, else of the first known end-of-text name."""
    names: list[str] = []
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        eos = None
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str):
        names.append(eos)
    for name in [*names, *EOD_NAMES]:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    return None

"""``hetctl data prepare``: text files in, a Megatron indexed dataset out.

Documents are tokenized in batches, each followed by the tokenizer's
end-of-document id, and written through :class:`hetctl.corpus.indexed.IndexedWriter`:
the dataset appears under its name only once complete. The result is a
:class:`Report` — counts, and what was skipped with where it first happened.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from hetctl.corpus import indexed, sources
from hetctl.corpus.tokenize import Tokenizer
from hetctl.errors import ConfigError

BATCH = 256  # documents per tokenizer call: the Rust tokenizer runs a batch on its own threads


@dataclass(frozen=True)
class Options:
    """What ``prepare`` was asked (one frozen value from the CLI)."""

    inputs: tuple[Path, ...]
    prefix: Path
    txt_split: str = "paragraph"
    text_key: str = "text"
    max_doc_bytes: int = 1 << 20


@dataclass
class Report:
    """What a prepare run wrote and what it left out (``skipped``: reason → count; ``first``: reason → place)."""

    prefix: str
    tokenizer: str
    vocab_size: int
    eod: int
    dtype: str
    documents: int = 0
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def check_inputs(opts: Options) -> int:
    """Every input exists with a known suffix; their total size in bytes (the progress bar's length)."""
    if not opts.inputs:
        raise ConfigError("no input files", "name one or more .txt, .jsonl or .parquet files")
    if opts.txt_split not in sources.SPLITS:
        raise ConfigError(f"--txt-split {opts.txt_split!r} is not one of {', '.join(sources.SPLITS)}")
    if opts.max_doc_bytes < 1:
        raise ConfigError("--max-doc-bytes must be at least 1")
    total = 0
    for p in opts.inputs:
        sources.kind_of(p)
        if not p.is_file():
            raise ConfigError(f"{p}: no such input file")
        total += p.stat().st_size
    return total


def prepare(opts: Options, tok: Tokenizer, advance: Callable[[int], None] = lambda n: None) -> Report:
    """Tokenize every input into ``opts.prefix`` (.bin + .idx); nothing is left under that name on failure."""
    check_inputs(opts)
    dtype = indexed.token_dtype(tok.vocab_size)
    report = Report(str(opts.prefix), tok.name, tok.vocab_size, tok.eod, dtype.name)
    skips = sources.Skips()
    parent = opts.prefix.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{parent}: cannot create the output folder: {e.strerror}") from None
    try:
        with indexed.IndexedWriter(opts.prefix, dtype) as writer:
            batch: list[str] = []
            for path in opts.inputs:
                for text in sources.documents(path, split=opts.txt_split, text_key=opts.text_key,
                                              max_bytes=opts.max_doc_bytes, skips=skips, advance=advance):
                    batch.append(text)
                    if len(batch) == BATCH:
                        _write(writer, tok, batch)
                        batch = []
            _write(writer, tok, batch)
            if not writer.lengths:
                left_out = ", ".join(f"{n} {sources.REASONS[r]}" for r, n in skips.counts.items()) or "none"
                raise ConfigError(f"no documents left to write: every input was empty or skipped ({left_out})",
                                  "check the inputs, --text-key and --max-doc-bytes")
            writer.commit()
            report.documents, report.tokens = len(writer.lengths), writer.tokens
    except OSError as e:
        raise ConfigError(f"{opts.prefix}: cannot write the dataset: {e.strerror}") from None
    report.skipped, report.first = dict(skips.counts), dict(skips.first)
    return report


def _write(writer: indexed.IndexedWriter, tok: Tokenizer, texts: list[str]) -> None:
    for ids in tok.encode_batch(texts):
        doc = np.empty(len(ids) + 1, dtype=np.int64)
        doc[:-1] = ids
        doc[-1] = tok.eod
        writer.add_document(doc)

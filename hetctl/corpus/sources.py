"""Documents from input files: ``.txt``, ``.jsonl`` (a text field) and ``.parquet`` (a text column).

What a document is:

- ``.txt``: a paragraph — lines up to the next blank line (``--txt-split paragraph``, the default);
  or each line (``line``); or the whole file (``file``).
- ``.jsonl``: each line's JSON object's text field (``--text-key``, default ``text``).
- ``.parquet``: each row's text column (needs pyarrow).

Nothing here raises on a bad document: it is counted in :class:`Skips` with the
place of the first one, and the run goes on. Bytes that are not UTF-8 are
replaced by U+FFFD (the document is kept, and counted); a document longer than
``max_bytes`` is skipped without ever being held whole in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from hetctl.errors import ConfigError

SPLITS = ("paragraph", "line", "file")
SUFFIXES = (".txt", ".jsonl", ".parquet")

REASONS = {
    "empty": "empty documents skipped",
    "overlong": "over-long documents skipped (> --max-doc-bytes)",
    "bad_json": "lines that are not JSON objects skipped",
    "no_text": "records without a text string skipped",
    "replaced": "documents with bytes that are not UTF-8 kept, those bytes replaced by U+FFFD",
}


@dataclass
class Skips:
    """What was left out or changed, by reason (:data:`REASONS`), with where it first happened."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def note(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first.setdefault(reason, where)


def kind_of(path: Path) -> str:
    """The input's kind by suffix, or a ConfigError naming the file."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"{path}: unknown input kind {suffix or '(no suffix)'!r}",
                          f"inputs are {', '.join(SUFFIXES)} files")
    return suffix[1:]


def documents(path: Path, *, split: str = "paragraph", text_key: str = "text", max_bytes: int = 1 << 20,
              skips: Skips, advance: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The documents of one input file, in file order; ``advance(bytes)`` reports progress through it."""
    kind = kind_of(path)
    if kind == "parquet":
        yield from _parquet(path, text_key, max_bytes, skips, advance)
        return
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a generator holds it across yields
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    with f:
        if kind == "jsonl":
            yield from _jsonl(path, f, text_key, max_bytes, skips, advance)
        elif split == "line":
            for n, raw, _ in _lines(f, max_bytes, advance):
                text = _keep(raw, f"{path}:{n}", skips)
                if text is not None:
                    yield text
        else:
            yield from _blocks(path, f, split == "file", max_bytes, skips, advance)


def _lines(f: BinaryIO, max_bytes: int, advance: Callable[[int], None]) -> Iterator[tuple[int, bytes | None, int]]:
    """``(line number, line without its newline, bytes read)``; the line is None when longer than
    ``max_bytes`` (its rest is read and dropped in 1 MiB pieces)."""
    n = 0
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        n += 1
        size = len(line)
        if size > max_bytes and not line.endswith(b"\n"):
            while not line.endswith(b"\n"):
                line = f.readline(1 << 20)
                if not line:
                    break
                size += len(line)
            advance(size)
            yield n, None, size
        else:
            advance(size)
            yield n, line.rstrip(b"\r\n"), size


def _keep(raw: bytes | None, where: str, skips: Skips) -> str | None:
    """The document's text, or None when it is skipped (over-long, empty); invalid UTF-8 is replaced."""
    if raw is None:
        skips.note("overlong", where)
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        skips.note("replaced", where)
        text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        skips.note("empty", where)
        return None
    return text


def _blocks(path: Path, f: BinaryIO, whole: bool, max_bytes: int, skips: Skips,
            advance: Callable[[int], None]) -> Iterator[str]:
    """Paragraphs (or the whole file): lines joined until a blank line; over-long ones dropped."""
    parts: list[bytes] = []
    size, start, overlong = 0, 1, False

    def flush(where: str) -> Iterator[str]:
        if overlong:
            skips.note("overlong", where)
        elif parts:
            text = _keep(b"\n".join(parts), where, skips)
            if text is not None:
                yield text

    for n, raw, _ in _lines(f, max_bytes, advance):
        if not whole and raw is not None and not raw.strip():
            yield from flush(f"{path}:{start}")
            parts, size, start, overlong = [], 0, n + 1, False
            continue
        if raw is None or size + len(raw) + 1 > max_bytes:
            overlong, parts = True, []
        elif not overlong:
            parts.append(raw)
            size += len(raw) + 1
    yield from flush(f"{path}:{start}")
    if whole and not parts and not overlong:
        skips.note("empty", str(path))


def _jsonl(path: Path, f: BinaryIO, key: str, max_bytes: int, skips: Skips,
           advance: Callable[[int], None]) -> Iterator[str]:
    for n, raw, _ in _lines(f, max_bytes, advance):
        where = f"{path}:{n}"
        if raw is None:
            skips.note("overlong", where)
            continue
        if not raw.strip():
            skips.note("empty", where)
            continue
        try:
            record = json.loads(raw.decode("utf-8", errors="strict"))
        except UnicodeDecodeError:
            skips.note("replaced", where)
            record = _loads(raw.decode("utf-8", errors="replace"))
        except ValueError:
            record = None
        if not isinstance(record, dict):
            skips.note("bad_json", where)
            continue
        text = record.get(key)
        if not isinstance(text, str):
            skips.note("no_text", where)
        elif not text.strip():
            skips.note("empty", where)
        else:
            yield text


def _loads(s: str) -> object:
    try:
        return json.loads(s)
    except ValueError:
        return None


def _parquet(path: Path, key: str, max_bytes: int, skips: Skips, advance: Callable[[int], None]) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{path}: reading .parquet needs pyarrow", "pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ConfigError(f"{path}: not a parquet file: {str(e).splitlines()[0]}") from None
    if key not in pf.schema_arrow.names:
        raise ConfigError(f"{path}: no column {key!r} (columns: {', '.join(pf.schema_arrow.names)})",
                          "name the text column with --text-key")
    rows, size, row = max(pf.metadata.num_rows, 1), path.stat().st_size, 0
    for batch in pf.iter_batches(batch_size=1024, columns=[key]):
        for value in batch.column(0).to_pylist():
            row += 1
            where = f"{path}: row {row}"
            if not isinstance(value, str):
                skips.note("no_text", where)
            elif len(value) > max_bytes or len(value.encode("utf-8", errors="replace")) > max_bytes:
                skips.note("overlong", where)
            elif not value.strip():
                skips.note("empty", where)
            else:
                yield value
        advance(size * batch.num_rows // rows)

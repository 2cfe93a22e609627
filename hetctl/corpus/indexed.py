"""Megatron's indexed dataset: ``PREFIX.bin`` (tokens) and ``PREFIX.idx`` (where each sequence lies).

The format Megatron-LM, megatron-core and FlagScale read (``MMIDIDX``, version 1).
The ``.idx`` file is, little-endian::

    9 bytes   b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code of the tokens in .bin (DTYPE_CODES)
    u64       sequence count S
    u64       document count D (entries of document_indices: documents + 1)
    i32[S]    sequence_lengths, in tokens
    i64[S]    sequence_pointers, byte offset of each sequence in .bin
    i64[D]    document_indices: sequence index where each document starts; the last is S
    (i8[S]    sequence modes, multimodal datasets only: ignored here)

The ``.bin`` file is the sequences' tokens back to back. hetctl writes one
sequence per document, as Megatron's ``preprocess_data.py`` does without sentence
splitting. Everything read from a file is checked, and a bad field is named.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetctl.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
HEADER_BYTES = _HEAD.size  # 34

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, int32 above."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """``(PREFIX.bin, PREFIX.idx)``."""
    p = str(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


class IndexedWriter:
    """Writes a dataset through temporary files renamed into place by :meth:`commit`.

    Until commit nothing named ``PREFIX.bin``/``PREFIX.idx`` is touched, so an
    interrupted or failed run leaves any earlier dataset as it was and never a
    half-written index. Use as a context manager: leaving it without commit
    (an exception, Ctrl-C) removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        self.bin_path, self.idx_path = paths(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no code in the indexed format")
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed by commit() or abort()
        self.lengths: list[int] = []
        self.tokens = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """Append one document as one sequence (``tokens`` already holds its end-of-document id)."""
        arr = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes())
        self.lengths.append(int(arr.size))
        self.tokens += int(arr.size)

    def commit(self) -> None:
        """Write the index, fsync both files, then rename ``.bin`` and ``.idx`` into place (in that order)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int64)
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ConfigError(f"{self.idx_path}: a document of {int(lengths.max())} tokens does not fit the "
                              "format's int32 sequence_lengths")
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(lengths.size + 1, dtype=np.int64)  # one sequence per document
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, VERSION, CODE_OF[self.dtype], lengths.size, documents.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(documents.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)

    def abort(self) -> None:
        """Close and remove the temporary files (no-op after commit)."""
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


@dataclass(frozen=True)
class IndexedDataset:
    """A dataset opened read-only: the index's arrays, and the tokens as one memory-mapped array.

    Attributes:
        prefix: the path prefix it was opened with.
        dtype: the tokens' dtype (from the header's code).
        sequence_lengths, sequence_pointers, document_indices: the index's arrays.
        tokens: every token of ``.bin`` in file order (the sequences back to back).
    """

    prefix: str
    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i``'s tokens."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size) - 1

    def document_token_start(self, doc: int) -> int:
        """Offset in :attr:`tokens` of document ``doc``'s first token (``num_documents`` → the end)."""
        seq = int(self.document_indices[doc])
        if seq >= len(self):
            return int(self.tokens.size)
        return int(self.sequence_pointers[seq]) // self.dtype.itemsize

    def max_token(self, chunk: int = 1 << 24) -> int:
        """The largest token id in ``.bin`` (-1 when empty), read in chunks so memory stays flat."""
        top = -1
        for i in range(0, self.tokens.size, chunk):
            top = max(top, int(self.tokens[i:i + chunk].max()))
        return top


def _fail(path: Path, field: str, what: str, hint: str | None = None) -> ConfigError:
    return ConfigError(f"{path}: {field} {what}", hint or "rewrite it with `hetctl data prepare` or Megatron's "
                       "tools/preprocess_data.py")


def open_dataset(prefix: str | Path) -> IndexedDataset:
    """Open ``PREFIX.bin`` + ``PREFIX.idx``, checking the header and that both files agree.

    Raises:
        ConfigError: a file is missing or unreadable, or a field is wrong (named, with its value).
    """
    bin_path, idx_path = paths(prefix)
    for p in (idx_path, bin_path):
        if not p.is_file():
            raise ConfigError(f"{p}: no such file (dataset prefix {prefix})",
                              "pass the prefix without .bin/.idx, as written by `hetctl data prepare -o PREFIX`")
    try:
        idx_size = idx_path.stat().st_size
        with open(idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise ConfigError(f"{idx_path}: cannot read: {e.strerror}") from None
    if len(head) < HEADER_BYTES:
        raise _fail(idx_path, "header", f"is truncated ({len(head)} of {HEADER_BYTES} bytes)")
    magic, version, code, seqs, docs = _HEAD.unpack(head)
    if magic != MAGIC:
        raise _fail(idx_path, "header", f"starts {magic!r}, not {MAGIC!r}: not a Megatron indexed dataset index")
    if version != VERSION:
        raise _fail(idx_path, "version", f"is {version}; only version {VERSION} is known")
    if code not in DTYPE_CODES:
        raise _fail(idx_path, "dtype code", f"is {code}, not one of {sorted(DTYPE_CODES)}")
    dtype = DTYPE_CODES[code]
    need = HEADER_BYTES + 12 * seqs + 8 * docs
    if idx_size not in (need, need + seqs):  # + an int8 mode per sequence in multimodal datasets
        raise _fail(idx_path, "size", f"is {idx_size} bytes; sequence_count={seqs} and document_count={docs} "
                    f"need {need}")
    raw = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(raw, dtype="<i4", count=seqs, offset=HEADER_BYTES)
    pointers = np.frombuffer(raw, dtype="<i8", count=seqs, offset=HEADER_BYTES + 4 * seqs)
    documents = np.frombuffer(raw, dtype="<i8", count=docs, offset=HEADER_BYTES + 12 * seqs)
    _check_arrays(idx_path, dtype, lengths, pointers, documents)
    bin_size = bin_path.stat().st_size
    want = int(lengths.sum(dtype=np.int64)) * dtype.itemsize
    if bin_size != want:
        raise _fail(bin_path, "size", f"is {bin_size} bytes; the index's sequence_lengths say {want} "
                    f"({dtype} tokens): the .bin and .idx are from different writes")
    tokens = np.memmap(bin_path, mode="r", dtype=dtype) if bin_size else np.zeros(0, dtype=dtype)
    return IndexedDataset(str(prefix), dtype, lengths, pointers, documents, tokens)


def _check_arrays(path: Path, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray) -> None:
    """The index's arrays are consistent: lengths >= 0, sequences back to back, documents cover every sequence."""
    if lengths.size and int(lengths.min()) < 0:
        raise _fail(path, "sequence_lengths", f"has a negative length ({int(lengths.min())})")
    if lengths.size:
        expect = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=expect[1:])
        bad = np.flatnonzero(pointers != expect)
        if bad.size:
            i = int(bad[0])
            raise _fail(path, f"sequence_pointers[{i}]", f"is {int(pointers[i])}, expected {int(expect[i])} "
                        "(sequences back to back)")
    if documents.size == 0 or int(documents[0]) != 0:
        raise _fail(path, "document_indices", "must start with 0")
    if int(documents[-1]) != lengths.size:
        raise _fail(path, "document_indices", f"ends at {int(documents[-1])}, not at sequence_count={lengths.size}")
    if documents.size > 1 and bool((np.diff(documents) < 0).any()):
        raise _fail(path, "document_indices", "is not increasing")

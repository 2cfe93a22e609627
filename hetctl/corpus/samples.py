"""The trainer's samples: windows of ``seq_len + 1`` tokens, by (seed, step, row of the global batch).

A dataset's documents (each ending in the end-of-document id) are read as one
token stream, cut into windows ``[w·L, w·L + L + 1)`` for ``L = seq_len``
(windows overlap by the one token that is the last target of one and the first
input of the next, as in Megatron's GPT dataset). Global sample ``g = (step − 1)·B
+ row`` of a run with global batch ``B`` is, in a blend:

1. the dataset: position ``g mod P`` of a fixed pattern of ``P`` = :data:`BLEND_PERIOD` slots in which
   each dataset holds its weight's share (largest remainder) spread evenly, so its own counter is
   ``(g div P)·share + slots before`` — no state, any ``g`` in O(1);
2. that dataset's ``j``-th sample: epoch ``e = j div W`` of its ``W`` windows, window ``perm_e(j mod W)``,
   ``perm_e`` a permutation seeded by (seed, dataset, epoch).

So a sample depends only on (seed, step, row): every rank builds exactly its rows,
a resumed run and a re-planned one (other DP, PP or TP, same global batch) see
the samples an undisturbed run would. A sample's id is ``"<dataset>:<window>"``.

Held-out split: unless ``--eval-data`` names other data, the last
:data:`HELD_OUT` of each training dataset's documents (at least one) is kept out
of training and evaluated on instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from hetctl.corpus.indexed import IndexedDataset, open_dataset
from hetctl.errors import ConfigError

BLEND_PERIOD = 10_000  # weights are honoured to 1/P: 0.7/0.3, 1/3 … to four decimals
HELD_OUT = 0.01  # share of documents held out for validation when no --eval-data is given
TOKEN_DTYPES = ("uint8", "int8", "int16", "uint16", "int32", "int64")


@dataclass(frozen=True)
class Part:
    """One dataset of a blend: its windows over ``tokens`` (a slice of the file's token stream)."""

    name: str
    weight: float
    tokens: np.ndarray
    seq_len: int

    @property
    def windows(self) -> int:
        return max(0, (int(self.tokens.size) - 1) // self.seq_len)

    def window(self, w: int) -> np.ndarray:
        return self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1]


def parse_blend(words: list[str]) -> list[tuple[float, str]]:
    """Megatron's ``--data-path`` syntax: ``PREFIX`` alone, or ``W1 P1 W2 P2 …`` (weights normalised).

    Raises:
        ConfigError: odd pairs, a weight that is not a positive number.
    """
    if len(words) == 1:
        return [(1.0, words[0])]
    if not words or len(words) % 2:
        raise ConfigError(f"--data {' '.join(words)}: give one PREFIX, or weight/PREFIX pairs (0.7 A 0.3 B)")
    pairs = []
    for w, p in zip(words[::2], words[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(f"--data: {w!r} is not a weight (pairs are WEIGHT PREFIX)") from None
        if not weight > 0 or weight == float("inf"):
            raise ConfigError(f"--data: weight {w} of {p} must be a positive number")
        pairs.append((weight, p))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def check_dataset(ds: IndexedDataset, vocab_size: int) -> None:
    """Token ids fit the model: an integer dtype and a largest id below ``vocab_size``."""
    if ds.dtype.name not in TOKEN_DTYPES:
        raise ConfigError(f"{ds.prefix}.idx: dtype is {ds.dtype.name}, not a token type ({', '.join(TOKEN_DTYPES)})")
    top = ds.max_token()
    if top >= vocab_size:
        raise ConfigError(f"{ds.prefix}.bin: token id {top} >= the model's vocab_size {vocab_size}",
                          "prepare the data with the model's tokenizer, or use a model with a larger vocab_size")
    if ds.dtype.kind == "i" and ds.tokens.size and int(ds.tokens.min()) < 0:
        raise ConfigError(f"{ds.prefix}.bin: negative token id {int(ds.tokens.min())}")


def held_out_start(ds: IndexedDataset) -> int:
    """The first token of the held-out documents (the last :data:`HELD_OUT`, at least one, when there are two)."""
    docs = ds.num_documents
    if docs < 2:
        return int(ds.tokens.size)
    keep = max(1, int(round(docs * HELD_OUT)))
    return ds.document_token_start(docs - keep)


class Blend:
    """Global samples of a blend of datasets, as rows of ``seq_len + 1`` tokens.

    Args:
        parts: the datasets, with normalised weights.
        seed: the run's seed.
        global_batch: rows per step (``g = (step − 1)·global_batch + row``).
        shuffle: False for evaluation: each dataset's windows in order, from the first.
    """

    def __init__(self, parts: list[Part], seed: int, global_batch: int, shuffle: bool = True) -> None:
        for p in parts:
            if p.windows < 1:
                raise ConfigError(f"{p.name}: {p.tokens.size} tokens, fewer than one window of seq_len+1="
                                  f"{p.seq_len + 1}", "use more data or a shorter --seq-len")
        self.parts, self.seed, self.global_batch, self.shuffle = parts, seed, global_batch, shuffle
        self.pattern, self.before, self.share = blend_pattern([p.weight for p in parts])

    def sample(self, g: int) -> tuple[int, int]:
        """``(dataset, window)`` of global sample ``g``."""
        slot = g % BLEND_PERIOD
        d = int(self.pattern[slot])
        j = (g // BLEND_PERIOD) * int(self.share[d]) + int(self.before[slot])
        part = self.parts[d]
        epoch, pos = divmod(j, part.windows)
        return d, int(self._perm(d, epoch)[pos]) if self.shuffle else pos

    @lru_cache(maxsize=4)  # noqa: B019 - a few live blends per process; the cache is their purpose
    def _perm(self, d: int, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, d, epoch]))
        return rng.permutation(self.parts[d].windows)

    def ids(self, step: int, first: int, count: int) -> list[str]:
        """Sample ids ``"<dataset>:<window>"`` of rows ``first .. first+count-1`` of ``step``."""
        base = (step - 1) * self.global_batch + first
        return [f"{d}:{w}" for d, w in (self.sample(base + i) for i in range(count))]

    def rows(self, step: int, first: int, count: int) -> np.ndarray:
        """Rows ``first .. first+count-1`` of ``step``'s global batch: int64 ``[count, seq_len + 1]``."""
        base = (step - 1) * self.global_batch + first
        out = [self.parts[d].window(w) for d, w in (self.sample(base + i) for i in range(count))]
        return np.stack(out).astype(np.int64)


def blend_pattern(weights: list[float], period: int = BLEND_PERIOD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dataset per slot, that dataset's slots before it, slots per dataset)`` over one period.

    Shares are the weights' largest-remainder apportionment of ``period``; slots go
    greedily to the dataset furthest behind its share (Megatron's blending rule),
    so every prefix of the pattern is within one sample of the weights.
    """
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * period
    share = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - share), kind="stable")[: period - int(share.sum())]:
        share[i] += 1
    pattern = np.empty(period, dtype=np.int32)
    before = np.empty(period, dtype=np.int64)
    taken = np.zeros(len(w), dtype=np.int64)
    frac = share / period
    for s in range(period):
        d = int(np.argmax(frac * (s + 1) - taken))
        pattern[s], before[s] = d, taken[d]
        taken[d] += 1
    return pattern, before, share


def open_blend(words: list[str], *, seq_len: int, vocab_size: int) -> list[tuple[float, IndexedDataset]]:
    """Open and check every dataset of ``--data``/``--eval-data`` (before torch: errors name file and field)."""
    out = []
    for weight, prefix in parse_blend(words):
        ds = open_dataset(prefix)
        check_dataset(ds, vocab_size)
        out.append((weight, ds))
    return out


def training_data(data: list[str], eval_data: list[str] | None, *, seq_len: int, vocab_size: int, seed: int,
                  global_batch: int) -> tuple[Blend, Blend | None]:
    """The training blend and the evaluation blend (``--eval-data``, else the held-out split; None if empty)."""
    train = open_blend(data, seq_len=seq_len, vocab_size=vocab_size)
    if eval_data:
        held = open_blend(eval_data, seq_len=seq_len, vocab_size=vocab_size)
        evals = [Part(ds.prefix, w, ds.tokens, seq_len) for w, ds in held]
        parts = [Part(ds.prefix, w, ds.tokens, seq_len) for w, ds in train]
    else:
        cuts = [held_out_start(ds) for _, ds in train]
        parts = [Part(ds.prefix, w, ds.tokens[:c], seq_len) for (w, ds), c in zip(train, cuts)]
        evals = [Part(f"{ds.prefix} (held-out split)", w, ds.tokens[c:], seq_len) for (w, ds), c in zip(train, cuts)]
    ev = Blend(evals, seed, global_batch, shuffle=False) if all(p.windows for p in evals) else None
    return Blend(parts, seed, global_batch), ev


def source_record(blend: Blend) -> list[list]:
    """What a checkpoint records of the training data (``[weight, file name, tokens]`` per dataset), so a
    resume on other data is noticed; the name without its folder, which may differ from node to node."""
    return [[round(p.weight, 6), Path(p.name).name, int(p.tokens.size)] for p in blend.parts]


def describe(blend: Blend) -> str:
    """One line: each dataset's weight, windows and tokens (the trainer prints it at start)."""
    return "; ".join(f"{Path(p.name).name} w={p.weight:.3g} windows={p.windows} tokens={p.tokens.size}"
                     for p in blend.parts)

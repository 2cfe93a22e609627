"""Compressed gradient sync on the links between vendors (``--grad-compress``).

Between vendors the data-parallel reduce goes over gloo on TCP, the slowest
link of a mixed cluster; :mod:`hetctl.train.dpreduce` hands exactly that part
(a flat all-reduce whose holders span vendors, or the cross-vendor pieces of
the hierarchical one) to a :class:`Compressor`. Inside one vendor nothing
changes. The modes:

* ``none``: fp32, as before (the bytes are still counted).
* ``bf16``: the all-reduce runs on a bf16 copy (half the bytes; no error feedback,
  the rounding is 2⁻⁹ relative per element and per addition).
* ``int8``: each rank quantizes its share to int8 with one fp32 scale per
  :data:`CHUNK` elements (round to nearest), the ranks all-gather the int8 values
  and scales, and every rank adds the dequantized shares in group-rank order, so
  every holder gets the same bits. A ring all-reduce of fp32 sends
  ``2(d−1)/d · 4n`` bytes, the all-gather ``(d−1) · n``: a quarter at two vendors.
* ``powersgd:R``: PowerSGD (Vogels et al., 2019) on each weight matrix's gradient
  ``M`` (``rows × cols``; under the hierarchy, the whole rows of it in a piece):
  ``P = all_reduce(M Q)``, orthonormalized, ``Q = all_reduce(Mᵀ P)``, and the sum
  is ``P Qᵀ``. ``Q`` is warm-started from the previous step. It sends
  ``R·(rows + cols)`` floats instead of ``rows·cols``; vectors (norms, biases), rows cut
  by a piece's ends and matrices too small to gain go in fp32.

int8 and PowerSGD keep error feedback: what a rank's share lost to compression
(``M − decompress(compress(M))``, its own part of the result) is added to its
next gradient, so nothing is lost, only late. The residuals and PowerSGD's ``Q``
are this rank's state: carried across steps and kept in checkpoints (one file a
rank, :func:`hetctl.train.gradmode.state_file`), so a resumed run continues bit for bit.

The orthonormalization and ``P Qᵀ`` run in float64 before rounding to float32, so
that hosts of different CPU kinds (another BLAS, another vector width) still give
the replicas the same bits.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from hetctl.train.gradmode import CHUNK, Mode, ring_bytes

Part = tuple[str, torch.Tensor, list[tuple[int, int]]]
"""What :meth:`Compressor.all_reduce` sums: a state key, a CPU float32 vector, its ``(numel, cols)`` runs."""


class Compressor:
    """One rank's compressed all-reduce (sum) over a cross-vendor gloo group, with its state.

    Args:
        mode: the ``--grad-compress`` value.
    """

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.error: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self._int8_last: torch.Tensor | None = None  # int8: the fed vector this step's owed views point into
        self._int8_spare: torch.Tensor | None = None  # int8: the one before, free for the next step
        self._free: dict[str, torch.Tensor] = {}  # PowerSGD: last step's fed gradients, this step's owed buffers
        self.sent = 0
        """Bytes this rank sent on the cross-vendor path since the attempt started (as a ring sends them)."""
        self.raw = 0
        """What the same reduces would have sent in fp32."""

    # -- the reduce ---------------------------------------------------------------------
    def count(self, numel: int, d: int) -> None:
        """Count an uncompressed fp32 all-reduce of ``numel`` elements over ``d`` ranks (mode ``none``)."""
        self.raw += ring_bytes(numel, 4, d)
        self.sent += ring_bytes(numel, 4, d)

    def all_reduce(self, group: dist.ProcessGroup, parts: list[Part]) -> None:
        """Sum each CPU float32 1-D tensor of ``parts`` over ``group``, in place; every member gets the same bits.

        A part is ``(key, tensor, runs)``: ``key`` names its state (error feedback), ``runs`` is its
        layout as :func:`hetctl.train.dpreduce.segments` gives it (PowerSGD's matrices). Every member
        calls it with the same keys, sizes and runs, in one order (they hold the same pieces).
        """
        if not parts:
            return
        d = dist.get_world_size(group)
        n = sum(t.numel() for _, t, _ in parts)
        self.raw += ring_bytes(n, 4, d)
        kind = self.mode.kind
        if kind == "none":
            flat = torch.cat([t for _, t, _ in parts])
            dist.all_reduce(flat, group=group)
            self.sent += ring_bytes(n, 4, d)
            _scatter_range(flat, 0, parts)
        elif kind == "bf16":
            flat = torch.cat([t for _, t, _ in parts]).to(torch.bfloat16)
            dist.all_reduce(flat, group=group)
            self.sent += ring_bytes(n, 2, d)
            _scatter_range(flat.float(), 0, parts)
        elif kind == "int8":
            self._int8(group, d, parts)
        else:
            self._powersgd(group, d, parts)

    def _fed(self, key: str, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient plus what earlier steps' compression owed it: into ``out``, else into the owed buffer
        (a new one replaces it), else a copy."""
        e = self.error.get(key)
        if e is None or e.shape != t.shape:
            return t.clone() if out is None else out.copy_(t)
        return e.add_(t) if out is None else torch.add(t, e, out=out)

    def _int8(self, group: dist.ProcessGroup, d: int, parts: list[Part]) -> None:
        # One vector for the whole batch: its chunks may span two parts, but only the last chunk is padded.
        n = sum(t.numel() for _, t, _ in parts)
        fed = self._int8_buffer(n + (-n % CHUNK))  # padded here, so quantize needs no copy
        fed[n:].zero_()
        at = 0
        for key, t, _ in parts:
            self._fed(key, t, out=fed[at:at + t.numel()])
            at += t.numel()
        rows = fed.view(-1, CHUNK)
        q = torch.empty(rows.shape, dtype=torch.int8)
        s = torch.empty(rows.shape[0])
        # A block of chunks at a time, so the temporaries stay small and in cache: the same values per element.
        for r0 in range(0, rows.shape[0], BLOCK_ROWS):
            r1 = min(rows.shape[0], r0 + BLOCK_ROWS)
            q[r0:r1], s[r0:r1] = quantize(rows[r0:r1].reshape(-1))
            rows[r0:r1].sub_(dequantize(q[r0:r1], s[r0:r1], (r1 - r0) * CHUNK).view(-1, CHUNK))  # what it lost
        owed = fed[:n]
        at = 0
        for key, t, _ in parts:
            self.error[key] = owed[at:at + t.numel()]
            at += t.numel()
        got_q = [torch.empty_like(q) for _ in range(d)]
        got_s = [torch.empty_like(s) for _ in range(d)]
        dist.all_gather(got_q, q, group=group)
        dist.all_gather(got_s, s, group=group)
        self.sent += (d - 1) * (q.numel() + 4 * s.numel())
        for r0 in range(0, rows.shape[0], BLOCK_ROWS):
            r1 = min(rows.shape[0], r0 + BLOCK_ROWS)
            total = dequantize(got_q[0][r0:r1], got_s[0][r0:r1], (r1 - r0) * CHUNK)
            for q_r, s_r in zip(got_q[1:], got_s[1:]):  # group-rank order: the same additions on every member
                total += dequantize(q_r[r0:r1], s_r[r0:r1], (r1 - r0) * CHUNK)
            _scatter_range(total, r0 * CHUNK, parts)

    def _int8_buffer(self, size: int) -> torch.Tensor:
        """This step's fed vector: not the one last step's owed views point into (they are read into it)."""
        spare = self._int8_spare
        buf = spare if spare is not None and spare.numel() == size else torch.empty(size)
        self._int8_spare, self._int8_last = self._int8_last, buf
        return buf

    def _powersgd(self, group: dist.ProcessGroup, d: int, parts: list[Part]) -> None:
        r = self.mode.rank
        fed = [self._fed(key, t) for key, t, _ in parts]  # copies: the results go straight into the parts
        low: list[tuple[int, int, int, int, str]] = []  # (part, start, rows, cols, Q's key)
        dense: list[tuple[int, int, int]] = []  # (part, start, numel): vectors, cut rows, matrices too small to gain
        for i, (key, t, runs) in enumerate(parts):
            at = 0
            for j, (numel, cols) in enumerate(runs or [(t.numel(), 0)]):
                rows = numel // cols if cols else 0
                if cols and r * (rows + cols) < numel:
                    low.append((i, at, rows, cols, f"{key}/{j}"))
                else:
                    dense.append((i, at, numel))
                at += numel
        # What this step owes goes into last step's gradient buffers (free now): no new pages every step.
        owed = [_reuse(self._free.pop(key, None), f) for (key, _, _), f in zip(parts, fed)]
        if dense:  # summed exactly: nothing owed
            flat = torch.cat([fed[i][a:a + n] for i, a, n in dense])
            dist.all_reduce(flat, group=group)
            self.sent += ring_bytes(flat.numel(), 4, d)
            at = 0
            for i, a, n in dense:
                parts[i][1][a:a + n] = flat[at:at + n]
                owed[i][a:a + n] = 0.0
                at += n
        if low:
            ms = [fed[i][a:a + rows * cols].view(rows, cols) for i, a, rows, cols, _ in low]
            qs = []
            for _, _, _, cols, key in low:
                q = self.q.get(key)
                qs.append(q if q is not None and q.shape == (cols, r) else _initial_q(key, cols, r))
            ps = torch.cat([(m @ q).reshape(-1) for m, q in zip(ms, qs)])
            dist.all_reduce(ps, group=group)
            self.sent += ring_bytes(ps.numel(), 4, d)
            pmats, at = [], 0
            for m in ms:
                pmats.append(_orthonormal(ps[at:at + m.shape[0] * r].view(m.shape[0], r)))
                at += m.shape[0] * r
            # This rank's Q before the sum, in float32: it is this rank's alone (the all-reduce makes the sum
            # the same on every member), as is its error feedback below.
            mine = [(p.float().T @ m).T for m, p in zip(ms, pmats)]  # Mᵀ P as (Pᵀ M)ᵀ: one wide product, 7× faster
            total = torch.cat([q.reshape(-1) for q in mine])
            dist.all_reduce(total, group=group)
            self.sent += ring_bytes(total.numel(), 4, d)
            at = 0
            for (i, a, rows, cols, key), m, p, q_mine in zip(low, ms, pmats, mine):
                q = total[at:at + cols * r].view(cols, r).clone()
                at += cols * r
                self.q[key] = q  # the warm start of the next step
                # Feedback: this rank's share less its own part of the result (the parts sum to the result).
                torch.addmm(m, p.float(), q_mine.T, alpha=-1.0, out=owed[i][a:a + rows * cols].view(rows, cols))
                # The result in float64 before rounding: every member, whatever its BLAS, gets the same bits.
                _product64(p, q, parts[i][1][a:a + rows * cols].view(rows, cols))
        for (key, _, _), e, f in zip(parts, owed, fed):
            self.error[key] = e
            self._free[key] = f

    # -- the state ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A copy of the state (for a checkpoint; training goes on changing the live one)."""
        return {"mode": str(self.mode),
                "error": {k: v.clone() for k, v in self.error.items()},
                "q": {k: v.clone() for k, v in self.q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> str | None:
        """Take a checkpoint's state; returns why it was not taken (another mode), else None."""
        if state.get("mode") != str(self.mode):
            return f"it was written with --grad-compress {state.get('mode')}, this run has {self.mode}"
        self.error = {k: v.float() for k, v in state.get("error", {}).items()}
        self.q = {k: v.float() for k, v in state.get("q", {}).items()}
        return None


def quantize(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk int8 of a 1-D float tensor: values ``(chunks, CHUNK)`` and one fp32 scale a chunk."""
    pad = -v.numel() % CHUNK
    x = (torch.nn.functional.pad(v, (0, pad)) if pad else v).view(-1, CHUNK)
    low, high = torch.aminmax(x, dim=1)
    scale = torch.maximum(high, low.neg_()).div_(127.0)  # the largest magnitude, without a copy of |x|
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk stays zero
    y = torch.div(x, scale[:, None])
    q = y.round_().clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 values :func:`quantize` stands for, cut to ``numel``."""
    return q.view(-1, CHUNK).float().mul_(scale[:, None]).reshape(-1)[:numel]


BLOCK_ROWS = 1024  # int8: chunks quantized or summed at a time (1 Mi values, 4 MiB of float32)


def _scatter_range(block: torch.Tensor, start: int, parts: list[Part]) -> None:
    """Copy ``block``, the values ``start…`` of the parts laid end to end, into the parts it covers."""
    end = start + block.numel()
    at = 0
    for _, t, _ in parts:
        lo, hi = max(at, start), min(at + t.numel(), end)
        if lo < hi:
            t[lo - at:hi - at].copy_(block[lo - start:hi - start])
        at += t.numel()


def _reuse(buf: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return buf if buf is not None and buf.shape == like.shape else torch.empty_like(like)


ROWS64 = 2048  # rows of P·Qᵀ made in float64 at a time: 4 MiB at 256 columns, in cache, no page faults


def _product64(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """``out = P Qᵀ`` (float32), each element summed in float64 and rounded once, a block of rows at a time."""
    qt = q.double().T
    buf = torch.empty(min(ROWS64, p.shape[0]), qt.shape[1], dtype=torch.float64)
    for r0 in range(0, p.shape[0], ROWS64):
        n = min(ROWS64, p.shape[0] - r0)
        torch.mm(p[r0:r0 + n], qt, out=buf[:n])
        out[r0:r0 + n].copy_(buf[:n])


def _initial_q(key: str, cols: int, r: int) -> torch.Tensor:
    """A Gaussian start for ``Q``, the same on every member: seeded by the segment's key."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(cols, r, generator=g)


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    """Gram–Schmidt on the columns of ``p`` in float64 (a zero column stays zero).

    Classical Gram–Schmidt applied twice per column ("CGS2", as accurate as the modified
    one): two matrix-vector products against the columns before it, not one dot product each.
    """
    p = p.double().clone()
    for i in range(p.shape[1]):
        col = p[:, i]
        if i:
            done = p[:, :i]
            for _ in range(2):
                col -= done @ (done.T @ col)
        norm = col.norm()
        p[:, i] = col / norm if norm > 0 else col
    return p

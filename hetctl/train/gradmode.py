"""What ``--grad-compress`` asks for (pure; no torch): the trainer's parser, and so ``hetctl launch --args``, read it.

The compression itself is :mod:`hetctl.train.gradcomp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

KINDS = ("none", "bf16", "int8", "powersgd")
CHUNK = 1024
"""int8: elements per fp32 scale (4 bytes of scale per 1024 bytes of values, 0.4%)."""


@dataclass(frozen=True)
class Mode:
    """A ``--grad-compress`` value: its kind and, for PowerSGD, its rank."""

    kind: str = "none"
    rank: int = 0

    def __str__(self) -> str:
        return f"powersgd:{self.rank}" if self.kind == "powersgd" else self.kind

    @property
    def feedback(self) -> bool:
        """Whether the mode keeps error feedback (and so per-rank state that checkpoints carry)."""
        return self.kind in ("int8", "powersgd")


def parse_mode(text: str) -> Mode:
    """``none``, ``bf16``, ``int8`` or ``powersgd:R`` (R ≥ 1). Raises ValueError saying what is wrong."""
    kind, sep, rank = text.strip().partition(":")
    if kind == "powersgd":
        if not rank.isdigit() or int(rank) < 1:
            raise ValueError(f"{text!r}: powersgd needs its rank, a whole number >= 1, as in powersgd:4")
        return Mode("powersgd", int(rank))
    if kind not in KINDS or sep:
        raise ValueError(f"{text!r} is not one of none, bf16, int8, powersgd:R")
    return Mode(kind)


def state_file(rank: int) -> str:
    """The checkpoint file of one rank's compression state (error feedback, PowerSGD's Q)."""
    return f"gradcomp-rank-{rank:05d}.pt"


def ring_bytes(numel: int, itemsize: int, d: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements of ``itemsize`` bytes over ``d`` ranks."""
    return (2 * (d - 1) * numel * itemsize) // d


def saved_state(ckpt_dir, step: int, rank: int, digest: str) -> tuple[bytes | None, str | None]:
    """This rank's compression state in checkpoint ``step`` (verified against the manifest), or why there is none.

    A checkpoint written without error feedback, or assembled from the survivors' just-in-time dumps (which
    carry none), has no such file: the run goes on, its feedback starting from zero.
    """
    from hetctl.node.manifest import read_verified, require_manifest

    name = state_file(rank)
    if name not in require_manifest(ckpt_dir, step, digest).get("files", {}):
        return None, f"checkpoint step-{step} holds no {name}; error feedback starts from zero"
    return read_verified(ckpt_dir, step, [name], digest)[name], None


def wire_fraction(mode: Mode, d: int, numel: float, matrices: Sequence[tuple[int, int]] = ()) -> float:
    """Bytes a rank sends reducing ``numel`` fp32 gradient elements over ``d`` ranks in ``mode``, as a fraction
    of the fp32 ring all-reduce's (what the planner prices on a cross-vendor link; :mod:`hetctl.train.gradcomp`
    sends exactly this).

    ``matrices``: the ``(rows, cols)`` weight matrices among the elements (PowerSGD compresses those where
    ``R·(rows + cols) < rows·cols``; the rest goes in fp32). int8 all-gathers, ``(d − 1)·n·(1 + 4/CHUNK)``
    bytes against the ring's ``2(d − 1)/d·4n``: a quarter at two ranks, as much as fp32 at eight.
    """
    if d < 2 or numel <= 0 or mode.kind == "none":
        return 1.0
    if mode.kind == "bf16":
        return 0.5
    if mode.kind == "int8":
        return d * (1 + 4 / CHUNK) / 8
    low = [(r, c) for r, c in matrices if mode.rank * (r + c) < r * c]
    dense = numel - sum(r * c for r, c in low)
    return (max(dense, 0.0) + sum(mode.rank * (r + c) for r, c in low)) / numel


P2P_MODES = ("none", "bf16")


def p2p_elem_bytes(precision_a: str, precision_b: str, crosses_vendors: bool, p2p_compress: str) -> int:
    """Bytes per element the reference trainer sends on a pipeline link (activations one way, their gradients
    the other), and what the planner prices it at: 2 (bfloat16) when both stages compute in bf16, or when the
    link crosses vendors under ``--p2p-compress bf16``; else 4 (fp32, which every stage accepts). Both ends
    of a link decide it from the same plan."""
    if precision_a == precision_b == "bf16" or (crosses_vendors and p2p_compress == "bf16"):
        return 2
    return 4

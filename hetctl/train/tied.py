"""Tied embeddings across pipeline stages, as Megatron-LM keeps them (its "embedding group").

With ``tie_embeddings`` the output projection is the token table. Under one
stage the head simply uses the embedding's parameter. When the head is on
another stage (pp > 1), that last stage holds a *copy* of the table:

* the copy starts equal to the table — both come from the embedding's seeded
  generator (:func:`hetctl.train.model.build_units`), or both from the same
  ``--init-from`` tensor, or both from ``embedding.pt`` on resume (the copy is
  never saved: the checkpoint stores the table once, in the ``embedding`` unit);
* every step, the gradients of the table and of its copy are summed between
  the first and the last stage of each replica (one two-rank group per replica
  and TP rank), before the data-parallel reduction of the embedding unit; after
  it, the first stage's reduced gradient is broadcast to the copy. Both then take
  the same AdamW step from the same state, so they stay equal: bit for bit where
  the two stages run the same kind of chip, within rounding across vendors.

The two-rank groups run on gloo: the first and last stage may sit on different
vendors, and the table's gradient is one tensor per step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


def tied_copy(units: nn.ModuleDict) -> nn.Parameter | None:
    """The last stage's copy of the table (a tied head without the embedding beside it), else None."""
    head = units["head"] if "head" in units else None
    if head is None or not getattr(head, "tied", False) or "embedding" in units:
        return None
    return head._table[0]


def pairs(unit_groups: tuple[tuple[str, tuple[int, ...], str], ...]) -> list[tuple[int, int]]:
    """``(first-stage rank, last-stage rank)`` of every replica and TP rank whose two differ, in one order for all."""
    emb = [m for name, m, _ in unit_groups if name == "embedding"]
    head = [m for name, m, _ in unit_groups if name == "head"]
    return [(a, b) for e, h in zip(emb, head) for a, b in zip(e, h) if a != b]


class TiedTable:
    """This rank's part in keeping the table and its copy equal (a no-op on ranks that hold neither)."""

    def __init__(self, rank: int, unit_groups: Any, units: nn.ModuleDict, new_group: Callable[..., Any]) -> None:
        self.param: nn.Parameter | None = None
        self.group = None
        self.src = None
        for a, b in pairs(unit_groups):  # every rank creates every group, in the same order
            g = new_group([a, b], backend="gloo")
            if rank in (a, b):
                self.group, self.src = g, a
        if self.group is not None:
            self.param = units["embedding"].tokens.weight if "embedding" in units else tied_copy(units)

    def _wire(self) -> torch.Tensor:
        assert self.param is not None
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        return self.param.grad.detach().to("cpu", copy=True) if self.param.device.type != "cpu" \
            else self.param.grad

    def sum_grads(self) -> None:
        """Table gradient + copy gradient, on both (before the data-parallel reduction)."""
        if self.group is None:
            return
        wire = self._wire()
        dist.all_reduce(wire, group=self.group)
        if wire is not self.param.grad:
            self.param.grad.copy_(wire)

    def broadcast(self) -> None:
        """The first stage's reduced gradient to the copy (after the data-parallel reduction)."""
        if self.group is None:
            return
        wire = self._wire()
        dist.broadcast(wire, src=self.src, group=self.group)
        if wire is not self.param.grad:
            self.param.grad.copy_(wire)

"""Weight gradients left for later: the W passes of the ZB-H1 schedule (:mod:`hetctl.plan.zerobubble`).

While :func:`deferring` is on, every linear layer of the model (:class:`Linear`, and the tied
head's projection) runs through :class:`_Deferred`: its backward computes only the gradient of
its input (``dx = g·W``, what the previous stage waits for) and keeps ``(x, g)``; the gradients
of its weight and bias (``dW = gᵀx``, ``db = Σg``) are computed when the schedule runs that
micro-batch's W pass (:meth:`Store.run`), and added to ``.grad`` as autograd would. Everything
else (norms, the embedding, attention's own products, TP's all-reduces) keeps its ordinary
backward, inside B. Off, a :class:`Linear` is :class:`torch.nn.Linear` itself: 1F1B and
validation pay nothing.

Under autocast the products run in its dtype, as autocast's ``linear`` does, and the weight
gradient is cast to the weight's dtype when it is added (the master weights stay fp32).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class Store:
    """The held-back weight gradients of one rank: the current B's, then one W item per micro-batch."""

    def __init__(self) -> None:
        self.active = False
        self._cache: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._items: deque[tuple[int, list]] = deque()

    def put(self, x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._cache.append((x, g, weight, bias))

    def close(self, micro: int) -> None:
        """The B of ``micro`` is done: what its backward held back is that micro-batch's W."""
        self._items.append((micro, self._cache))
        self._cache = []

    def run(self, micro: int) -> None:
        """Micro-batch ``micro``'s W: the weight and bias gradients of every linear layer, added to ``.grad``."""
        if not self._items or self._items[0][0] != micro:
            held = [m for m, _ in self._items]
            raise RuntimeError(f"W pass of micro-batch {micro} out of order (held: {held})")  # a schedule bug
        _, work = self._items.popleft()
        with torch.no_grad():
            for x, g, weight, bias in work:
                g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
                _accumulate(weight, g2.t().mm(x2))
                if bias is not None:
                    _accumulate(bias, g2.sum(0))

    def drop(self) -> int:
        """Forget whatever is held; returns how many W passes (and an unclosed B's) that was."""
        left = len(self._items) + bool(self._cache)
        self._cache, self._items = [], deque()
        return left


def _accumulate(p: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(p.dtype)
    if p.grad is None:
        p.grad = grad
    else:
        p.grad.add_(grad)


STORE = Store()


@contextlib.contextmanager
def deferring(store: Store = STORE) -> Iterator[Store]:
    """Linear layers hold back their weight gradients inside this block (the step's forwards and B passes)."""
    store.active = True
    try:
        yield store
    finally:
        store.active = False
        if left := store.drop():
            raise RuntimeError(f"{left} W pass(es) never ran")  # a schedule bug, not user input


class _Deferred(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):  # type: ignore[override]
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            xc, wc = x.to(dt), weight.to(dt)
            bc = bias.to(dt) if bias is not None else None
        else:
            xc, wc, bc = x, weight, bias
        with torch.autocast(dev, enabled=False):
            out = F.linear(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.weight, ctx.bias = store, weight, bias
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        xc, wc = ctx.saved_tensors
        g = g.to(wc.dtype)
        ctx.store.put(xc, g, ctx.weight, ctx.bias)
        return g.matmul(wc), None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, holding back the weight gradients while :func:`deferring` is on and gradients are taken."""
    if STORE.active and torch.is_grad_enabled() and weight.requires_grad:
        return _Deferred.apply(x, weight, bias, STORE)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` (same parameters and state dict) whose weight gradients may wait for a W pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if STORE.active:
            return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

"""One training step of a pipeline stage: the 1F1B schedule over micro-batches.

Activations go forward and their gradients come back with torch.distributed
point-to-point operations. Sends are non-blocking and only receives wait, so
the 1F1B order cannot deadlock; all sends are completed before the optimizer
step. A link whose comm library is gloo (across vendors, or CPU) carries CPU
tensors; a vendor library (nccl, hccl…) carries device tensors.

Order is fixed everywhere that sums floats: micro-batch gradients accumulate in
micro-batch order, data-parallel all-reduces go one checkpoint unit at a time
(the buffer layout, hence the summation order, does not depend on the split),
so a run is reproducible bit for bit and any split of the same layers over the
same data-parallel width gives the same numbers.

Interleaved plans (``parallel.virtual_stages`` v > 1) run Megatron-LM's
interleaved 1F1B: each rank holds v chunks, chunk c being virtual stage
``c·pp + stage``, in the order :func:`hetctl.plan.interleave.schedule_interleaved`
gives (the very order the planner simulates). Between chunks a micro-batch
crosses from the last stage back to the first. Every chunk's backwards still
run in micro-batch order, so gradients accumulate in the same order as under
plain 1F1B and the numbers do not change.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetctl.plan.zerobubble import schedule_zbh1
from hetctl.train import zbstore
from hetctl.train.gradmode import p2p_elem_bytes
from hetctl.train.topology import Topology

Op = tuple[str, int]


def schedule_1f1b(stage: int, stages: int, micro_batches: int) -> list[Op]:
    """The 1F1B order of one stage: ``("F", m)`` forward, ``("B", m)`` backward of micro-batch ``m``.

    Stage ``s`` runs ``stages - s - 1`` warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards. At most
    ``stages - s`` micro-batches are in flight, against all of them in GPipe.
    """
    warm = min(stages - stage - 1, micro_batches)
    ops: list[Op] = [("F", m) for m in range(warm)]
    for i in range(micro_batches - warm):
        ops += [("F", warm + i), ("B", i)]
    ops += [("B", m) for m in range(micro_batches - warm, micro_batches)]
    return ops


class Comm:
    """Point-to-point and all-reduce for one rank, moving tensors to the CPU where the link is gloo."""

    def __init__(self, topo: Topology, device: torch.device,
                 groups: Mapping[str, tuple[dist.ProcessGroup, str]] | None = None, p2p_compress: str = "none") -> None:
        """Args:
            groups: per unit of this stage, its data-parallel group and that group's comm library
                (empty without data parallelism).
            p2p_compress: ``bf16``: activations and their gradients cross a stage boundary between two vendors
                in bfloat16 (half the bytes; both ends round alike, so runs stay reproducible); ``none``: fp32
                there. Between two bf16 stages they go in bf16 either way
                (:func:`hetctl.train.gradmode.p2p_elem_bytes`, which the planner prices too).
        """
        self.topo = topo
        self.device = device
        self.groups = dict(groups or {})
        self.p2p_compress = p2p_compress
        self.xv_p2p_bytes = 0
        """Bytes this rank sent on p2p links across vendors (activations and gradients), since it started."""
        self.wait_s = 0.0
        """Seconds spent blocked on communication since the last :meth:`take_wait`."""
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _wire(self, backend: str | None, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous() if backend == "gloo" else t.detach().contiguous()

    def dtype(self, crosses: bool, peer_precision: str = "fp32") -> torch.dtype:
        """The dtype a p2p link carries (:func:`hetctl.train.gradmode.p2p_elem_bytes`). Both ends of a link
        decide it from the same plan, so the receiver's buffer matches what is sent."""
        two = p2p_elem_bytes(self.topo.precision, peer_precision, crosses, self.p2p_compress) == 2
        return torch.bfloat16 if two else torch.float32

    def _recv(self, backend: str | None, src: int, shape: tuple[int, ...], tag: int, crosses: bool = False,
              peer_precision: str = "fp32") -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype(crosses, peer_precision),
                          device="cpu" if backend == "gloo" else self.device)
        t0 = time.perf_counter()
        dist.irecv(buf, src=src, tag=tag).wait()
        self.wait_s += time.perf_counter() - t0
        return buf.to(self.device, torch.float32)

    def _send(self, backend: str | None, dst: int, t: torch.Tensor, tag: int, crosses: bool = False,
              peer_precision: str = "fp32") -> None:
        wire = self._wire(backend, t.to(self.dtype(crosses, peer_precision)))
        if crosses:
            self.xv_p2p_bytes += wire.numel() * wire.element_size()
        self._pending.append((dist.isend(wire, dst=dst, tag=tag), wire))

    def recv_activation(self, micro: int, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.topo
        return self._recv(t.backend_prev, t.prev_rank, shape, 2 * micro, t.crosses_prev, t.precision_prev)

    def send_activation(self, micro: int, t: torch.Tensor) -> None:
        o = self.topo
        self._send(o.backend_next, o.next_rank, t, 2 * micro, o.crosses_next, o.precision_next)

    def recv_grad(self, micro: int, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.topo
        return self._recv(t.backend_next, t.next_rank, shape, 2 * micro + 1, t.crosses_next, t.precision_next)

    def send_grad(self, micro: int, t: torch.Tensor) -> None:
        o = self.topo
        self._send(o.backend_prev, o.prev_rank, t, 2 * micro + 1, o.crosses_prev, o.precision_prev)

    def wait_sends(self) -> None:
        """Complete every outstanding send (their buffers are kept alive until then)."""
        t0 = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self.wait_s += time.perf_counter() - t0

    def take_wait(self) -> float:
        """Communication seconds since the last call (step time minus this is the stage's compute time)."""
        wait, self.wait_s = self.wait_s, 0.0
        return wait

    def all_reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum the last stages' loss shares over the replicas (a no-op without data parallelism)."""
        if "head" not in self.groups:
            return loss
        t0 = time.perf_counter()
        group, lib = self.groups["head"]
        wire = self._wire(lib, loss)
        dist.all_reduce(wire, group=group)
        self.wait_s += time.perf_counter() - t0
        return wire


class VirtualLinks:
    """The point-to-point links of an interleaved rank: to and from the neighbouring *virtual* stages.

    Virtual stage ``j`` receives its forward input from ``j − 1`` (the previous rank, or the last rank
    for rank 0's later chunks) and its gradient from ``j + 1``. Tags name the receiving virtual stage and
    the micro-batch, so the two directions between a pair of ranks never mix.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm, self.topo = comm, comm.topo

    def _tag(self, j: int, micro: int, grad: bool) -> int:
        return 2 * (j * self.topo.micro_batches + micro) + (1 if grad else 0)

    def _prev(self, j: int) -> tuple[int, str | None, bool, str]:
        t = self.topo
        return (t.prev_rank, t.backend_prev, t.crosses_prev, t.precision_prev) if t.stage > 0 else \
            (t.wrap_rank, t.backend_wrap, t.crosses_wrap, t.precision_wrap)

    def _next(self, j: int) -> tuple[int, str | None, bool, str]:
        t = self.topo
        return (t.next_rank, t.backend_next, t.crosses_next, t.precision_next) if t.stage < t.pp - 1 else \
            (t.wrap_rank, t.backend_wrap, t.crosses_wrap, t.precision_wrap)

    def recv_activation(self, j: int, micro: int, shape: tuple[int, ...]) -> torch.Tensor:
        peer, lib, crosses, prec = self._prev(j)
        return self.comm._recv(lib, peer, shape, self._tag(j, micro, False), crosses, prec)

    def send_activation(self, j: int, micro: int, t: torch.Tensor) -> None:
        peer, lib, crosses, prec = self._next(j)
        self.comm._send(lib, peer, t, self._tag(j + 1, micro, False), crosses, prec)

    def recv_grad(self, j: int, micro: int, shape: tuple[int, ...]) -> torch.Tensor:
        peer, lib, crosses, prec = self._next(j)
        return self.comm._recv(lib, peer, shape, self._tag(j, micro, True), crosses, prec)

    def send_grad(self, j: int, micro: int, t: torch.Tensor) -> None:
        peer, lib, crosses, prec = self._prev(j)
        self.comm._send(lib, peer, t, self._tag(j - 1, micro, True), crosses, prec)


def chunk_modules(module: nn.Module, topo: Topology) -> list[nn.Module]:
    """Per chunk, a module applying that chunk's units (the embedding on virtual stage 0, the head on the last)."""
    from hetctl.train.units import unit_names

    units = module.units
    last = topo.pp * topo.virtual_stages - 1
    out = []
    for c, span in enumerate(topo.chunks):
        j = c * topo.pp + topo.stage
        names = unit_names(span, j == 0, j == last)
        out.append(type(module)(nn.ModuleDict({n: units[n] for n in names})))
    return out


def train_step_interleaved(module, topo: Topology, comm: Comm, batch, hidden: int, seq_len: int, amp,
                           loss_scale: float = 1.0):
    """:func:`train_step` under interleaved 1F1B (same arguments and result)."""
    from hetctl.plan.interleave import FWD, schedule_interleaved

    shape = (topo.micro_batch, seq_len, hidden)
    scale = 1.0 / (topo.total_micro or topo.micro_batches * topo.dp)
    links = VirtualLinks(comm)
    parts = chunk_modules(module, topo)
    p, last = topo.pp, topo.pp * topo.virtual_stages - 1
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    loss_sum = torch.zeros((), dtype=torch.float32, device=comm.device) if topo.is_last else None
    order = schedule_interleaved(topo.stage, p, topo.virtual_stages, topo.micro_batches, topo.microbatch_group)
    for kind, c, m in order:
        j = c * p + topo.stage
        if kind == FWD:
            x = batch(m)[0] if j == 0 else links.recv_activation(j, m, shape).requires_grad_(True)
            with amp():
                y = parts[c](x)
            if j == last:
                logits = y.float()
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch(m)[1].reshape(-1)) * scale
                loss_sum += loss.detach()
                y = loss if loss_scale == 1.0 else loss * loss_scale
            else:
                links.send_activation(j, m, y)
            saved[(c, m)] = (x, y)
        else:
            x, y = saved.pop((c, m))
            if j == last:
                y.backward()
            else:
                y.backward(links.recv_grad(j, m, shape).to(y.dtype))
            if j > 0:
                links.send_grad(j, m, x.grad)
    comm.wait_sends()
    return loss_sum


LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The stage's compute precision, the plan's (``Stage.precision``): bf16 or fp16 autocast, none for fp32.

    Weights, gradients and the optimizer stay fp32 (autocast casts on the fly), so
    an fp16 stage needs only the run's loss scale (:class:`hetctl.train.optim.LossScaler`).
    The planner gives CPU stages fp32, so the reference runs stay fp32; a plan that asks
    a CPU stage for bf16 or fp16 gets it (the mixed-precision tests run that way).
    """
    dtype = LOW_PRECISION.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_step(
    module: nn.Module,
    topo: Topology,
    comm: Comm,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    hidden: int,
    seq_len: int,
    amp: Callable[[], contextlib.AbstractContextManager],
    loss_scale: float = 1.0,
) -> torch.Tensor | None:
    """Forward and backward of every micro-batch of one step, leaving summed gradients in ``.grad``.

    Args:
        module: this stage's units.
        topo: this rank's place.
        comm: its point-to-point links and data-parallel group.
        batch: ``micro -> (inputs, targets)`` on the device (first and last stage use it).
        hidden: model width, for receive buffers.
        seq_len: sequence length, for receive buffers.
        amp: a fresh autocast context per forward.
        loss_scale: the last stage back-propagates ``loss * loss_scale`` (a power of two; fp16 stages), so every
            stage's gradients come out scaled by it (:meth:`hetctl.train.optim.Stepper.unscale` undoes that).

    Returns:
        On the last stage, this replica's share of the step's mean loss (each
        micro-batch's mean cross-entropy divided by the step's micro-batches over every replica);
        None elsewhere.
    """
    if topo.virtual_stages > 1:
        return train_step_interleaved(module, topo, comm, batch, hidden, seq_len, amp, loss_scale)
    shape = (topo.micro_batch, seq_len, hidden)
    # Every micro-batch of the step weighs the same, whichever replica runs it (replicas may run different counts).
    scale = 1.0 / (topo.total_micro or topo.micro_batches * topo.dp)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float32, device=comm.device) if topo.is_last else None
    zb = topo.schedule == "zb-h1"
    with zbstore.deferring() if zb else contextlib.nullcontext() as store:
        for op, m in (schedule_zb(topo) if zb else schedule_1f1b(topo.stage, topo.pp, topo.micro_batches)):
            if op == "W":
                store.run(m)
                continue
            _one_op(op, m, module, topo, comm, batch, shape, amp, scale, loss_scale, inputs, outputs, loss_sum)
            if zb and op == "B":
                store.close(m)
    comm.wait_sends()
    return loss_sum


def schedule_zb(topo: Topology) -> list[Op]:
    """ZB-H1's order of this stage (:func:`hetctl.plan.zerobubble.schedule_zbh1`, the order the plan simulated):
    ``F``, ``B`` (input gradients only) and ``W`` (the weight gradients :mod:`hetctl.train.zbstore` held back)."""
    return [("FBW"[k], m) for k, m in schedule_zbh1(topo.stage, topo.pp, topo.micro_batches, topo.defer)]


def _one_op(op: str, m: int, module, topo: Topology, comm: "Comm", batch, shape, amp, scale: float, loss_scale: float,
            inputs: dict, outputs: dict, loss_sum: torch.Tensor | None) -> None:
    """One forward (``F``) or backward (``B``) of micro-batch ``m`` on this stage."""
    if op == "F":
        if topo.is_first:
            x = batch(m)[0]
        else:
            x = comm.recv_activation(m, shape).requires_grad_(True)
        with amp():
            y = module(x)
        if topo.is_last:
            logits = y.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch(m)[1].reshape(-1)) * scale
            loss_sum += loss.detach()
            y = loss if loss_scale == 1.0 else loss * loss_scale
        else:
            comm.send_activation(m, y)
        inputs[m], outputs[m] = x, y
    else:
        x, y = inputs.pop(m), outputs.pop(m)
        if topo.is_last:
            y.backward()
        else:
            y.backward(comm.recv_grad(m, shape).to(y.dtype))
        if not topo.is_first:
            comm.send_grad(m, x.grad)


@torch.no_grad()
def forward_only(module: nn.Module, topo: Topology, comm: Comm, batch, hidden: int, seq_len: int,
                 amp) -> torch.Tensor | None:
    """A forward pass of every micro-batch through the pipeline, no gradients: validation.

    Every stage takes part (same arguments as :func:`train_step`). Micro-batches go
    chunk by chunk in order; sends do not block, so no stage waits on one behind it.

    Returns:
        On the last stage, ``[summed token cross-entropy, tokens]`` of this replica (float64); None elsewhere.
    """
    shape = (topo.micro_batch, seq_len, hidden)
    links = VirtualLinks(comm)
    parts = chunk_modules(module, topo) if topo.virtual_stages > 1 else [module]
    last = topo.pp * topo.virtual_stages - 1
    total = torch.zeros(2, dtype=torch.float64, device=comm.device) if topo.is_last else None
    for c, part in enumerate(parts):
        j = c * topo.pp + topo.stage
        for m in range(topo.micro_batches):
            x = batch(m)[0] if j == 0 else links.recv_activation(j, m, shape)
            with amp():
                y = part(x)
            if j == last:
                logits = y.float()
                targets = batch(m)[1].reshape(-1)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum")
                total += torch.stack([loss.double(), torch.tensor(targets.numel(), dtype=torch.float64,
                                                                  device=comm.device)])
            else:
                links.send_activation(j, m, y)
    comm.wait_sends()
    return total

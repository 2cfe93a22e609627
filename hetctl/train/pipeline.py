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
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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
                 groups: Mapping[str, tuple[dist.ProcessGroup, str]] | None = None) -> None:
        """Args:
            groups: per unit of this stage, its data-parallel group and that group's comm library
                (empty without data parallelism).
        """
        self.topo = topo
        self.device = device
        self.groups = dict(groups or {})
        self.wait_s = 0.0
        """Seconds spent blocked on communication since the last :meth:`take_wait`."""
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _wire(self, backend: str | None, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous() if backend == "gloo" else t.detach().contiguous()

    def _recv(self, backend: str | None, src: int, shape: tuple[int, ...], tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=torch.float32, device="cpu" if backend == "gloo" else self.device)
        t0 = time.perf_counter()
        dist.irecv(buf, src=src, tag=tag).wait()
        self.wait_s += time.perf_counter() - t0
        return buf.to(self.device)

    def _send(self, backend: str | None, dst: int, t: torch.Tensor, tag: int) -> None:
        wire = self._wire(backend, t.float())
        self._pending.append((dist.isend(wire, dst=dst, tag=tag), wire))

    def recv_activation(self, micro: int, shape: tuple[int, ...]) -> torch.Tensor:
        return self._recv(self.topo.backend_prev, self.topo.prev_rank, shape, 2 * micro)

    def send_activation(self, micro: int, t: torch.Tensor) -> None:
        self._send(self.topo.backend_next, self.topo.next_rank, t, 2 * micro)

    def recv_grad(self, micro: int, shape: tuple[int, ...]) -> torch.Tensor:
        return self._recv(self.topo.backend_next, self.topo.next_rank, shape, 2 * micro + 1)

    def send_grad(self, micro: int, t: torch.Tensor) -> None:
        self._send(self.topo.backend_prev, self.topo.prev_rank, t, 2 * micro + 1)

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

    def all_reduce_grads(self, units: nn.ModuleDict) -> None:
        """Sum gradients over each unit's data-parallel group (its holders in every replica), in unit order.

        Unit order is one total order on every rank, so replicas of different shape, whose units sit at
        different stages, cannot deadlock: each group's members reach its all-reduces in the same order.
        """
        if not self.groups:
            return
        t0 = time.perf_counter()
        for name, unit in units.items():
            group, lib = self.groups[name]
            grads = [p.grad for p in unit.parameters()]
            flat = self._wire(lib, torch.cat([g.reshape(-1) for g in grads]))
            dist.all_reduce(flat, group=group)
            flat = flat.to(self.device)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.wait_s += time.perf_counter() - t0

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


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on accelerators when the plan asks for it; fp32 on the CPU (the reference runs)."""
    if precision == "bf16" and device.type != "cpu":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    module: nn.Module,
    topo: Topology,
    comm: Comm,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    hidden: int,
    seq_len: int,
    amp: Callable[[], contextlib.AbstractContextManager],
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

    Returns:
        On the last stage, this replica's share of the step's mean loss (each
        micro-batch's mean cross-entropy divided by the step's micro-batches over every replica);
        None elsewhere.
    """
    shape = (topo.micro_batch, seq_len, hidden)
    # Every micro-batch of the step weighs the same, whichever replica runs it (replicas may run different counts).
    scale = 1.0 / (topo.total_micro or topo.micro_batches * topo.dp)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float32, device=comm.device) if topo.is_last else None
    for op, m in schedule_1f1b(topo.stage, topo.pp, topo.micro_batches):
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
                y = loss
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
    comm.wait_sends()
    return loss_sum


def iter_params(units: nn.ModuleDict) -> Iterator[tuple[str, str, nn.Parameter]]:
    """``(unit, name, parameter)`` for every parameter, in unit order."""
    for uname, unit in units.items():
        for pname, p in unit.named_parameters():
            yield uname, pname, p

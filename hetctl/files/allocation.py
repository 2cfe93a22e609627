"""What a Slurm allocation holds, as an inventory's ``slurm:`` block takes it (plain data).

:func:`hetctl.files.inventory.load_inventory` turns these into inventory nodes (the
``defaults:``, the ``slurm_*`` labels, the ``switch`` label); asking Slurm for them is
the caller's part, through a function it passes in (``slurm=``, in practice
:func:`hetctl.remote.slurmalloc.allocation`), so that ``files/`` never runs a Slurm
command itself (tests/test_layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetctl.errors import HetctlError


@dataclass(frozen=True)
class AllocatedNode:
    """A node of the allocation as ``scontrol show node`` describes it, and where the job and the topology put it.

    Attributes:
        addr: Slurm's ``NodeAddr`` (the node's ``hostname``).
        het_group, het_component: in a heterogeneous job, the component holding the node (``srun --het-group``)
            and that component's own job id; None in a plain job.
        switch: the leaf switch (topology/tree) or block (topology/block) Slurm's topology puts the node under.
    """

    name: str
    addr: str
    cpus: int = 0
    memory_mb: int = 0
    gres: str = ""
    features: tuple[str, ...] = ()
    het_group: int | None = None
    het_component: str | None = None
    switch: str | None = None


@dataclass(frozen=True)
class Allocation:
    """The job a ``slurm:`` block names (a heterogeneous job's leader: the id srun takes) and its nodes, in order."""

    job: str
    nodes: tuple[AllocatedNode, ...]


class AllocationError(HetctlError):
    """The allocation does not match the inventory's ``slurm:`` block; ``key`` names the key below it."""

    def __init__(self, key: tuple[str, ...], message: str, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.key = key

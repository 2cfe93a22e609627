"""What DeepSpeed needs to run a plan as planned: its layer split and its launcher's rank order.

DeepSpeed's ``PipelineModule`` cuts the layer list only by ``uniform``,
``parameters`` or ``type:<regex>`` (each balanced by count or weight), so it
cannot make an uneven split such as [12, 12, 4, 4]. With
``partition_method="type:<decoder layer class>"`` every stage gets an equal
count of decoder layers, the remainder on the first stages; the planner plans
exactly that split for ``--framework deepspeed`` and the renderer refuses any
other (a hand-edited plan), saying why.

DeepSpeed's own launcher (``deepspeed``, ``deepspeed/launcher/runner.py`` and
``launch.py``) numbers ranks entry by entry in hostfile order; within an entry
of ``n`` processes the one with global rank ``g`` gets ``LOCAL_RANK = g % n``
and sees the entry's devices *sorted* (the runner sorts every ``--include``
list), and the hostfile may name a host once. :func:`launcher_files` writes
what makes it place every rank on its planned node and chip anyway: one
hostfile entry per run of a node's consecutive ranks (named after the node:
with ``--no_ssh`` each entry is one launcher started on its own node, so nodes
sharing an address are no trouble), split into one entry per rank where the
sorted, rotated device list would put a rank on another chip.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hetctl.errors import ConfigError
from hetctl.files.plan import Plan

_LABEL = re.compile(r"[^A-Za-z0-9._-]")  # no @ : , (the --include syntax)


def deepspeed_split(num_layers: int, stages: int) -> list[int] | None:
    """Decoder layers per stage as DeepSpeed's balanced partition of equal weights makes them."""
    if stages <= 0 or num_layers < stages:
        return None
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def check_deepspeed_split(split: list[int], stages: int) -> None:
    """Refuse a split that DeepSpeed's PipelineModule would not reproduce.

    Raises:
        ConfigError: ``split`` differs from :func:`deepspeed_split`.
    """
    want = deepspeed_split(sum(split), stages)
    if split != want:
        raise ConfigError(
            f"plan: layers per stage {split} cannot be given to DeepSpeed, whose PipelineModule partitions only "
            f"uniform, by parameters or by type: and would make {want}",
            "plan again with --framework deepspeed (it plans DeepSpeed's split), or use --framework flagscale "
            "or torchrun for an uneven split",
        )


@dataclass(frozen=True)
class Launcher:
    """DeepSpeed's launcher files for a plan.

    Attributes:
        hostfile: ``<entry> slots=<n>`` lines, entries in DeepSpeed rank order.
        include: the ``--include`` value (each entry's chips).
        entries: per entry, in ``--node_rank`` order, the node that runs its launcher.
    """

    hostfile: str
    include: str
    entries: tuple[str, ...]

    def node_ranks(self, node: str) -> list[int]:
        """The ``--node_rank`` of each launcher that runs on ``node``."""
        return [i for i, n in enumerate(self.entries) if n == node]


def _runs(ordered: list, chip_of) -> list[tuple[str, list[int]]]:
    """Maximal runs of consecutive ranks on one node, each split into single ranks where DeepSpeed's
    ``LOCAL_RANK = rank % n`` over the sorted chips would give a rank another chip than its own."""
    runs: list[tuple[str, list]] = []
    for g, r in enumerate(ordered):
        if runs and runs[-1][0] == r.node:
            runs[-1][1].append((g, chip_of(r)))
        else:
            runs.append((r.node, [(g, chip_of(r))]))
    out = []
    for node, members in runs:
        n = len(members)
        if any(c is None for _, c in members):  # CPU ranks: DeepSpeed places them by node, the count is all
            out.append((node, list(range(n))))
            continue
        chips = sorted(c for _, c in members)
        if len(set(chips)) == n and all(chips[g % n] == c for g, c in members):
            out.append((node, [c for _, c in members]))
        else:
            out += [(node, [c]) for _, c in members]
    return out


def launcher_files(plan: Plan, rank_of) -> Launcher:
    """The hostfile, ``--include`` and launchers under which ``deepspeed`` places every rank as planned.

    Args:
        plan: the plan.
        rank_of: the framework rank of a plan rank (DeepSpeed's topology order).

    CPU ranks (no chip) take slots 0, 1, … of their entry: DeepSpeed places them by node only.
    """
    runs = _runs(sorted(plan.ranks, key=rank_of), lambda r: r.chip)
    per_node: dict[str, int] = {}
    for node, _ in runs:
        per_node[node] = per_node.get(node, 0) + 1
    labels, seen, k = [], set(), dict.fromkeys(per_node, 0)
    for node, _ in runs:
        base = _LABEL.sub("_", node)
        k[node] += 1
        label = base if per_node[node] == 1 else f"{base}.{k[node]}"
        while label in seen:
            label += "_"
        seen.add(label)
        labels.append(label)
    hostfile = "".join(f"{label} slots={max(chips) + 1}\n" for label, (_, chips) in zip(labels, runs))
    include = "@".join(f"{label}:{','.join(map(str, chips))}" for label, (_, chips) in zip(labels, runs))
    return Launcher(hostfile, include, tuple(node for node, _ in runs))

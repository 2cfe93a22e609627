"""What DeepSpeed needs to run a plan as planned: its layer split and its launcher's rank order.

DeepSpeed's ``PipelineModule`` cuts the layer list only by ``uniform``,
``parameters`` or ``type:<regex>`` (each balanced by count or weight), so it
cannot make an uneven split such as [12, 12, 4, 4]. With
``partition_method="type:<decoder layer class>"`` every stage gets an equal
count of decoder layers, the remainder on the first stages; the planner plans
exactly that split for ``--framework deepspeed`` and the renderer refuses any
other (a hand-edited plan), saying why.

DeepSpeed's own launcher numbers ranks host by host in hostfile order, local
rank ``i`` on the ``i``-th device of the host's ``--include`` list. That
reproduces the plan's pipe-data-model ranks only when each node's ranks are
consecutive; :func:`launcher_files` says whether they are and gives the
hostfile and ``--include`` value then.
"""

from __future__ import annotations

import re

from hetctl.errors import ConfigError
from hetctl.files.plan import Plan

_HOST = re.compile(r"[A-Za-z0-9._-]+\Z")


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


def launcher_files(plan: Plan, hosts: dict[str, str], rank_of) -> tuple[str, str] | None:
    """The hostfile text and ``--include`` value under which ``deepspeed`` numbers ranks as planned.

    Args:
        plan: the plan.
        hosts: node name → address the launcher reaches it at.
        rank_of: the framework rank of a plan rank (DeepSpeed's topology order).

    Returns:
        None when the launcher cannot reproduce the plan: a node's ranks are
        not consecutive, a rank has no chip index (CPU), or an address is not
        a plain host name.
    """
    runs: list[tuple[str, list[int]]] = []
    for r in sorted(plan.ranks, key=rank_of):
        if r.chip is None:
            return None
        if runs and runs[-1][0] == r.node:
            runs[-1][1].append(r.chip)
        elif any(n == r.node for n, _ in runs):
            return None
        else:
            runs.append((r.node, [r.chip]))
    named = [(hosts.get(n, n), chips) for n, chips in runs]
    if any(not _HOST.match(h) for h, _ in named):
        return None
    hostfile = "".join(f"{h} slots={max(chips) + 1}\n" for h, chips in named)
    include = "@".join(f"{h}:{','.join(map(str, chips))}" for h, chips in named)
    return hostfile, include

"""Names of checkpoint units and their files (pure; no torch).

A unit is what one checkpoint file holds: ``embedding`` on the first stage,
``layer-NNNNN`` per transformer layer, ``head`` on the last stage. Naming them
by layer index, never by stage, is what lets any split load any checkpoint.
"""

from __future__ import annotations

STATE = "state.json"


def layer_name(index: int) -> str:
    """Unit (and checkpoint file stem) of transformer layer ``index``."""
    return f"layer-{index:05d}"


def unit_names(layers: tuple[int, int], first: bool, last: bool) -> list[str]:
    """A stage's units in forward order."""
    return (["embedding"] if first else []) + [layer_name(i) for i in range(*layers)] + (["head"] if last else [])


def unit_files(layers: tuple[int, int], first: bool, last: bool) -> list[str]:
    """The checkpoint files a stage loads: its units', plus ``state.json``."""
    return [f"{n}.pt" for n in unit_names(layers, first, last)] + [STATE]


def expected_files(num_layers: int) -> set[str]:
    """Every file a complete checkpoint of a ``num_layers`` model has (besides the manifest)."""
    return set(unit_files((0, num_layers), True, True))

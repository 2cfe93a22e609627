"""Checkpoint layout of the reference trainer (pure; no torch): unit names, files, state record.

A unit is what one checkpoint file holds: ``embedding`` on the first stage,
``layer-NNNNN`` per transformer layer, ``head`` on the last stage. Naming them
by layer index, never by stage, is what lets any split load any checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from hetctl.errors import ConfigError

STATE = "state.json"


def layer_name(index: int) -> str:
    """Unit (and checkpoint file stem) of transformer layer ``index``."""
    return f"layer-{index:05d}"


Spans = Union[tuple[int, int], Sequence[tuple[int, int]]]  # one range, or an interleaved stage's chunks


def _ranges(layers) -> list[tuple[int, int]]:
    """One ``(start, end)`` range, or several (the chunks of an interleaved stage), as a list of ranges."""
    return [tuple(layers)] if layers and isinstance(layers[0], int) else [tuple(r) for r in layers]


def unit_names(layers: Spans, first: bool, last: bool) -> list[str]:
    """A stage's units in forward order (layer order over all its chunks, under interleaving)."""
    mids = [layer_name(i) for a, b in _ranges(layers) for i in range(a, b)]
    return (["embedding"] if first else []) + mids + (["head"] if last else [])


def unit_files(layers: Spans, first: bool, last: bool, tied: bool = False) -> list[str]:
    """The checkpoint files a stage loads: its units' (:func:`stage_reads`), plus ``state.json``."""
    return [f"{n}.pt" for n in stage_reads(layers, first, last, tied)] + [STATE]


def stage_reads(layers: Spans, first: bool, last: bool, tied: bool) -> list[str]:
    """The units a stage loads: its own, and the embedding on a last stage that projects with a copy of it."""
    names = unit_names(layers, first, last)
    return names + (["embedding"] if tied and last and not first else [])


def expected_files(num_layers: int) -> set[str]:
    """Every file a complete checkpoint of a ``num_layers`` model has (besides the manifest)."""
    return set(unit_files((0, num_layers), True, True))


def check_state(state: Mapping[str, Any], seed: int, global_batch: int, optim: Any, where: Path) -> None:
    """Refuse a checkpoint taken with another seed or learning-rate schedule; warn when the batch, weight
    decay or clipping changed (``optim``: the run's :class:`hetctl.train.optim.OptimConfig`)."""
    from hetctl.train.optim import check_resume

    if state.get("seed") != seed:
        raise ConfigError(
            f"checkpoint {where}: written with --seed {state.get('seed')}, this run has --seed {seed}",
            f"pass --seed {state.get('seed')} to continue that run",
        )
    data = state.get("data", {})
    if data.get("global_batch") != global_batch:
        print(f"warning: checkpoint {where} was trained with global batch {data.get('global_batch')}, "
              f"continuing with {global_batch}; the data differs from an undisturbed run", file=sys.stderr)
    changed = check_resume(state.get("optimizer"), optim, where)
    if changed:
        print(f"warning: checkpoint {where} used other optimizer settings, continuing with {'; '.join(changed)}",
              file=sys.stderr)


def parse_test_delay(raw: str | None) -> tuple[int, float] | None:
    """``HETCTL_TEST_SAVE_DELAY=<step>:<seconds>``, test-only: the save of that step pauses in its writer.

    It pauses twice (:func:`hetctl.train.ckpt.write_units`): before serializing the
    snapshot, while training goes on, and after the files are written, before the
    manifest, so a test can check that a save writes the state of its own step and
    can kill a job while a save is provably in flight. Unset (always, outside
    tests) it changes nothing. Raises ValueError when malformed.
    """
    if not raw:
        return None
    step, sep, seconds = raw.partition(":")
    if not sep:
        raise ValueError(raw)
    return int(step), float(seconds)

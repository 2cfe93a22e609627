"""``hetctl launch``'s and ``resume``'s command-line words as values (``--entry``, ``--progress``, ``--args``),
and the signals that stop a run: the command line's side of :mod:`hetctl.elastic.start`."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

from hetctl.errors import ConfigError
from hetctl.launch import materialize as mat


def parse_entry(entry: str | None) -> tuple[str, ...]:
    """``--entry``: what each rank runs after the node's python (``-m pkg.mod …`` or ``script.py …``)."""
    import shlex

    if not entry:
        return mat.REFERENCE_TRAINER
    try:
        words = tuple(shlex.split(entry))
    except ValueError as e:
        raise ConfigError(f"--entry {entry!r}: {e}", "quote it like a shell command line") from None
    if not words or words == ("-m",):
        raise ConfigError(f"--entry {entry!r}: nothing to run", "e.g. --entry 'train.py --lr 3e-4'")
    return words


def parse_progress(value: str | None) -> str | None:
    """``--progress``: a preset (``megatron``, ``deepspeed``) or a regular expression with a ``(?P<step>…)`` group."""
    import re

    from hetctl.node.progress import PRESETS

    if not value or value in PRESETS:
        return value or None
    try:
        pattern = re.compile(value)
    except re.error as e:
        raise ConfigError(f"--progress {value!r}: not a regular expression: {e}",
                          f"use a preset ({', '.join(PRESETS)}) or a pattern like 'step (?P<step>\\d+) loss (?P<loss>\\S+)'") \
            from None
    if "step" not in pattern.groupindex:
        raise ConfigError(f"--progress {value!r}: the pattern has no (?P<step>…) group",
                          "name the step number's group `step`; `loss` and `step_ms` are optional")
    return value


def parse_args_option(value: str | None) -> tuple[str, ...]:
    """``--args``: the arguments of every rank's rendered command, split like a shell line."""
    import shlex

    try:
        return tuple(shlex.split(value or ""))
    except ValueError as e:
        raise ConfigError(f"--args {value!r}: {e}", "quote it like a shell command line") from None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM set the yielded event (stop every rank, end ``stopped``); a second one aborts.

    Only in the main thread (signal handlers cannot be installed elsewhere); a
    second signal raises KeyboardInterrupt, and the agents, seeing their stdin
    close, still stop their ranks.
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)

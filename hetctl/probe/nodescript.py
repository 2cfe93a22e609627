"""A node-side program shipped on stdin (``python - ARGS``) and the JSON it answers with.

The programs are stdlib-only files of ``hetctl/node/`` (:func:`hetctl.node.source`): the
collector, the matmul benchmark, the layer profile, the link benchmark. Each prints one JSON
object as its last line; anything else (``python`` missing, a crash, no JSON) is one
:class:`~hetctl.errors.RemoteError` naming the node.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from hetctl.errors import RemoteError

if TYPE_CHECKING:
    from hetctl.files.inventory import Node
    from hetctl.remote.base import Result, Transport


@lru_cache(maxsize=None)
def node_script(name: str) -> bytes:
    """Source of a node-side script shipped on stdin (``collector.py``, ``bench.py``)."""
    from hetctl.node import source

    return source(name).encode()


def _stderr_tail(result: Result) -> str:
    lines = [ln.strip() for ln in (result.stderr or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def decode_output(result: Result, python: str, what: str) -> dict[str, Any]:
    """Decode the JSON a node-side script printed, or raise a one-line RemoteError.

    Args:
        result: the finished run of ``python - ARGS``.
        python: the interpreter the inventory names for the node (for the hint).
        what: ``collector`` or ``benchmark``, for the message.
    """
    tail = _stderr_tail(result)
    if result.exit_code == 127 or (result.exit_code != 0 and "not found" in tail and python in tail):
        raise RemoteError(
            f"`{python}` not found on the node", "set `python:` for this node in the inventory", node=result.node
        )
    if result.exit_code != 0:
        raise RemoteError(f"{what} exited {result.exit_code}" + (f": {tail}" if tail else ""), node=result.node)
    text = (result.stdout or "").strip()
    last = text.splitlines()[-1] if text else ""
    try:
        data = json.loads(last)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise RemoteError(f"{what} printed no JSON" + (f": {tail}" if tail else ""), node=result.node)
    return data


def run_script(transport: Transport, node: Node, script: str, args: str, timeout: float, what: str) -> dict[str, Any]:
    """Run ``script`` on ``node`` (``python - ARGS``, its source on stdin) and decode its answer (:func:`decode_output`)."""
    python = node.python or "python3"
    # The transport adds the node's inventory ``env`` itself.
    result = transport.run([python, "-", args], input=node_script(script), timeout=timeout, check=False)
    return decode_output(result, python, what)

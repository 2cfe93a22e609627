"""Run one function on many nodes at once and keep one outcome per node.

Fabric's ``GroupResult`` idea, typed and built on :mod:`concurrent.futures`: a
failure on one node never hides the others' answers. Exceptions that are not
:class:`~hetctl.errors.HetctlError` are bugs; :meth:`GroupResult.raise_if_failed`
re-raises them unchanged so they keep their traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

from hetctl.errors import HetctlError, RemoteError

T = TypeVar("T")


def _name(node: Any) -> str:
    return node if isinstance(node, str) else node.name


class GroupFailed(RemoteError):
    """Some nodes failed; ``result`` holds every node's outcome."""

    def __init__(self, result: GroupResult) -> None:
        failed = result.failed
        lines = "; ".join(e.message if isinstance(e, HetctlError) else f"{n}: {e}" for n, e in failed.items())
        super().__init__(
            f"{len(failed)} of {len(result)} node(s) failed: {lines}",
            "the other nodes answered; fix or drop the failing ones from the inventory",
            node=next(iter(failed), None),
        )
        self.result = result


class GroupResult(Mapping[str, Any], Generic[T]):
    """Node name → the function's value, or the exception it raised. Input order is kept."""

    def __init__(self, outcomes: dict[str, T | BaseException]) -> None:
        self._outcomes = outcomes

    def __getitem__(self, name: str) -> T | BaseException:
        return self._outcomes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._outcomes)

    def __len__(self) -> int:
        return len(self._outcomes)

    def __repr__(self) -> str:
        return f"GroupResult(ok={list(self.ok)}, failed={list(self.failed)})"

    @property
    def ok(self) -> dict[str, T]:
        """The nodes that returned a value."""
        return {n: v for n, v in self._outcomes.items() if not isinstance(v, BaseException)}

    @property
    def failed(self) -> dict[str, BaseException]:
        """The nodes whose call raised."""
        return {n: v for n, v in self._outcomes.items() if isinstance(v, BaseException)}

    def raise_if_failed(self) -> None:
        """Raise a bug's exception as is; else :class:`GroupFailed` when any node failed."""
        failed = self.failed
        for exc in failed.values():
            if not isinstance(exc, HetctlError):
                raise exc
        if failed:
            raise GroupFailed(self)


def fanout(
    nodes: Iterable[Any],
    fn: Callable[[Any], T],
    *,
    max_workers: int = 64,
    on_done: Callable[[str, T | BaseException], None] | None = None,
) -> GroupResult[T]:
    """Call ``fn(node)`` for every node, at most ``max_workers`` at a time.

    Args:
        nodes: inventory nodes (anything with ``.name``) or plain names.
        fn: the work for one node; whatever it raises is recorded, not propagated.
        max_workers: concurrency bound (the inventory's ``ssh.fanout``).
        on_done: called in the calling thread as each node finishes, in completion
            order, with the node name and its value or exception (progress bars).

    Returns:
        One outcome per node, in the order the nodes were given.
    """
    nodes = list(nodes)
    names = [_name(n) for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"fanout over duplicate node names: {names}")
    outcomes: dict[str, Any] = dict.fromkeys(names)
    if not nodes:
        return GroupResult(outcomes)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(nodes))), thread_name_prefix="fanout") as pool:
        futures = {pool.submit(fn, node): name for node, name in zip(nodes, names)}
        for fut in as_completed(futures):
            name = futures[fut]
            exc = fut.exception()
            outcomes[name] = exc if exc is not None else fut.result()
            if on_done is not None:
                on_done(name, outcomes[name])
    return GroupResult(outcomes)

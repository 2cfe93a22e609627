"""What ships to a node: stdlib only (plus hetctl.errors and hetctl.vendors), packed into the agent zipapp."""

from functools import lru_cache
from importlib import resources


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """Source of a stdlib-only program in ``hetctl/node/`` that runs on a node as ``python -c`` (read once)."""
    return resources.files("hetctl.node").joinpath(name).read_text()

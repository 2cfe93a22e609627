"""What ships to a node: stdlib only (plus hetctl.errors and hetctl.vendors), packed into the agent zipapp."""

from functools import lru_cache
from importlib import resources


# First line of every program run as ``python -c`` or ``python -``: such a python puts its current folder
# first on sys.path, where another user (or a shared checkout) could have planted a json.py. The folder is
# the node's login folder or, on a local node, wherever hetctl was started; ``-I`` or ``-P`` would do the
# same but also drop the inventory's PYTHONPATH, or need Python 3.11.
NO_CWD_IMPORTS = 'import sys\nif sys.path and sys.path[0] in ("", "."):\n    del sys.path[0]\n'


# A program that runs as ``python -c`` or ``python -`` is one text: the node modules it imports go in front of
# it, in this order, and it imports them only where their names are not there yet (imported from the package).
BUNDLED = {"collector.py": ("toolrun.py",)}


@lru_cache(maxsize=None)
def source(name: str) -> str:
    """Source of a stdlib-only program in ``hetctl/node/`` that runs on a node as ``python -c`` (read once),
    behind :data:`NO_CWD_IMPORTS` and the modules it is shipped with (:data:`BUNDLED`)."""
    here = resources.files("hetctl.node")
    return NO_CWD_IMPORTS + "\n".join(here.joinpath(n).read_text() for n in (*BUNDLED.get(name, ()), name))

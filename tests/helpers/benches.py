"""Load a ``bench/`` script as a module, for tests of its parts (the benches are scripts, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` imported under the module name ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

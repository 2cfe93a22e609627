"""The README promises what the code does: its rank-contract table is the code's table."""

from __future__ import annotations

import re
from pathlib import Path

from hetctl.node.runtime import TRAIN_ENV

README = Path(__file__).resolve().parent.parent / "README.md"


def _readme_env_table() -> dict[str, str]:
    text = README.read_text()
    section = text.split("## The rank contract", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, flags=re.M)
    return dict(rows)


def test_readme_rank_contract_matches_runtime_table():
    assert _readme_env_table() == TRAIN_ENV


def test_readme_setup_commands_exist():
    text = README.read_text()
    assert "hetctl demo" in text
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = "python3 -m pytest -q"
    assert test_cmd in text and test_cmd in ci

"""The documentation promises what the code does.

The README is the overview (set-up, tour, commands); the reference lives in
docs/. Each check here reads the page where the content lives, and fails when
the code and the page drift apart.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hetctl.node.runtime import TRAIN_ENV

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _page(name: str) -> str:
    return (DOCS / name).read_text()


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    body = text.split(heading + "\n", 1)[1]
    stop = re.search(rf"^#{{1,{len(level)}}} ", body, flags=re.M)
    return body[:stop.start()] if stop else body


def test_rank_contract_page_matches_runtime_table():
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", _page("rank-contract.md"), flags=re.M)
    assert dict(rows) == TRAIN_ENV


def test_readme_setup_commands_exist():
    text = README.read_text()
    assert "pip install -e '.[dev]' && hetctl demo" in text
    assert "bash .ci/run" in text
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = "python3 -m pytest -q"
    assert test_cmd in text and test_cmd in ci


def test_readme_stays_an_overview():
    """The README is the front page: short, every command in its table, every docs page linked."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    from hetctl.cli import app
    import typer

    for name in typer.main.get_command(app).commands:
        assert f"| `hetctl {name}" in text, f"README's commands table lacks hetctl {name}"
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "index.md":
            assert f"(docs/{page.name})" in text, f"README does not link docs/{page.name}"


def test_exit_code_2_covers_these_cases():
    text = _section(_page("commands.md"), "## Exit codes")
    assert "| 2 | bad input: inventory, cluster, plan or model file, or an option" in text


def test_architecture_sections_cited_by_the_code_exist():
    """Every ``docs/architecture.md §N`` in the code names a numbered section of that page."""
    headings = set(re.findall(r"^## (\d+)\. ", _page("architecture.md"), flags=re.M))
    cited = set()
    for path in (ROOT / "hetctl").rglob("*.py"):
        cited |= set(re.findall(r"docs/architecture\.md §(\d+)", path.read_text()))
        assert "DESIGN §" not in path.read_text(), f"{path}: cites DESIGN, which is docs/architecture.md now"
    assert cited and cited <= headings, f"cited sections missing from docs/architecture.md: {cited - headings}"


def test_framework_table_matches_capabilities():
    from hetctl.plan.frameworks import CAPABILITIES

    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (\w+) \| (yes|no) \| (yes|no) \| (\w+) \| (yes|no) \|$",
                      _page("frameworks.md"), flags=re.M)
    table = {name: (tp, interleave == "yes", uneven == "yes", vendors, zb == "yes")
             for name, tp, interleave, uneven, vendors, zb in rows}
    assert table == {name: (cap.tp, cap.interleave, cap.uneven_dp, cap.vendors, cap.zero_bubble)
                     for name, cap in CAPABILITIES.items()}


@pytest.mark.parametrize("model_name", ["NodeEntry", "SshSettings", "SlurmSettings", "InventoryFile"])
def test_every_inventory_key_is_documented(model_name):
    from hetctl.files import inventory

    text = _page("inventory.md")
    for key in getattr(inventory, model_name).model_fields:
        assert f"`{key}`" in text or f"{key}:" in text, f"docs/inventory.md does not document {model_name}.{key}"


def _cli():
    import typer

    from hetctl.cli import app

    return typer.main.get_command(app)


def _undocumented(text: str) -> list[str]:
    """Commands and options of the typer app that ``text`` (docs/commands.md) does not name where it should."""
    root = _cli()
    missing = [f"hetctl {opt}" for param in root.params for opt in param.opts if f"`hetctl {opt}`" not in text]
    for name, command in root.commands.items():
        heading = f"## hetctl {name}"
        if heading + "\n" not in text:
            missing.append(heading)
            continue
        section = _section(text, heading)
        # A group (``hetctl data``) is documented in one section: each subcommand by name, with its options.
        subs = getattr(command, "commands", None)
        for sub, cmd in (subs.items() if subs else [("", command)]):
            label = f"hetctl {name} {sub}".rstrip()
            if sub and f"`{label}" not in section:
                missing.append(label)
            for param in cmd.params:
                if param.param_type_name == "option":  # typer's own click: not click.Option
                    missing += [f"{label} {opt}" for opt in [*param.opts, *param.secondary_opts] if f"`{opt}`" not in section]
    return missing


def test_every_command_and_option_is_in_the_docs():
    """Walk the typer app: each command has its section in docs/commands.md, naming every option it takes."""
    assert _undocumented(_page("commands.md")) == []


def test_the_walk_finds_an_option_missing_from_its_own_section():
    """An option documented under another command does not count: --force belongs to stop's section."""
    text = _page("commands.md")
    stop = _section(text, "## hetctl stop")
    assert _undocumented(text.replace(stop, stop.replace("`--force`", "`--f0rce`"))) == ["hetctl stop --force"]
    assert _undocumented(text.replace("## hetctl report\n", "## hetctl rep0rt\n")) == ["## hetctl report"]


def test_the_json_page_names_every_field_of_each_output_model():
    """docs/json.md lists the top-level fields of what each --json prints: checked against the models, so that
    a field added to a model is added to the page."""
    import dataclasses

    from hetctl.corpus.prepare import Report
    from hetctl.runs.status import RunView, StopResult
    from hetctl.files.cluster import Cluster
    from hetctl.files.plan import Plan
    from hetctl.files.run import RunSummary
    from hetctl.launch.materialize import LaunchSpec, NodeLaunch, RankLaunch

    page = (DOCS / "json.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")}
    want = {"`probe`": list(Cluster.model_fields), "`plan`": list(Plan.model_fields),
            "`launch`, `resume`": list(RunSummary.model_fields),
            "`status`": [f.name for f in dataclasses.fields(RunView)],
            "`stop`": [f.name for f in dataclasses.fields(StopResult)],
            "`data prepare`": [f.name for f in dataclasses.fields(Report)],
            "`launch --dry-run`": [f.name for c in (LaunchSpec, NodeLaunch, RankLaunch) for f in dataclasses.fields(c)]}
    for command, fields in want.items():
        missing = [f for f in fields if f"`{f}`" not in rows[command]]
        assert not missing, f"docs/json.md, {command}: {missing}"

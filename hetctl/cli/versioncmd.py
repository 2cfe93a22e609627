"""``hetctl version``: what this installation has, for a bug report or a mixed-software check.

Versions are read from the installed packages' metadata, never by importing them:
importing torch takes seconds, and a vendor plugin may initialise its device.
"""

from __future__ import annotations

import json
import platform
import sys
from importlib import metadata

import typer

from hetctl.cli.root import app
from hetctl.cli.base import handle_errors, out, print_json, text


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """hetctl, Python, torch and every vendor's torch plugin found here (``None`` where absent)."""
    from hetctl import __version__
    from hetctl.vendors import VENDOR_TABLE

    plugins = {row.plugin_dist: _dist_version(row.plugin_dist) for row in VENDOR_TABLE.values() if row.plugin_dist}
    return {"hetctl": __version__, "python": platform.python_version(), "executable": sys.executable,
            "torch": _dist_version("torch"), "vendor_plugins": {k: v for k, v in plugins.items() if v}}


@app.command("version")
@handle_errors
def version_cmd(as_json: bool = typer.Option(False, "--json", help="The versions as JSON on stdout.")) -> None:
    """Print the versions of hetctl, Python, torch and the vendor torch plugins found."""
    v = versions()
    if as_json:
        print_json(json.dumps(v, indent=2))
        return
    plugins = ", ".join(f"{k} {ver}" for k, ver in v["vendor_plugins"].items()) or "none"
    for key, value in (("hetctl", v["hetctl"]), ("python", f"{v['python']} ({v['executable']})"),
                       ("torch", v["torch"] or "not installed (probe, plan and launch need none)"),
                       ("vendor plugins", plugins)):
        out.print(text((f"{key}: ", "bold"), value), highlight=False, soft_wrap=True)

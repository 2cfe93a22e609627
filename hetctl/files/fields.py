"""Field types shared by the file models (inventory, cluster file, plan).

Node names and hosts end up in argv lists, file names, rendered launch scripts
and log lines, so they are held to what a hostname may contain; a name ending in
a newline, holding a space or a shell metacharacter is refused on load rather
than quoted in every place that uses it. Other free text may hold any printable
character but no control characters (no line breaks, no NUL).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

NODE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,252}")
# Hostnames, IPv4 and IPv6 literals (with a %zone): what ssh is given to dial. Never a
# leading '-', which ssh would read as an option (-oProxyCommand=…).
HOST_RE = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9_.:%-]{0,252}")
TFLOPS_MAX = 1e6  # a chip a thousand times today's largest is a typo, not a chip


class Strict(BaseModel):
    """The base of every file model: an unknown key is an error (a typo is never silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class Invalid(Exception):
    """A rule across fields is broken at ``loc`` (a key path).

    Raised by a model's ``check_consistency()``; :func:`hetctl.files.yamlio.load_model`
    turns it into a ConfigError with the file and line.
    """

    def __init__(self, loc: tuple[Any, ...], msg: str, hint: str | None = None) -> None:
        super().__init__(msg)
        self.loc, self.msg, self.hint = tuple(loc), msg, hint


def node_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a node name, or None when it can."""
    if NODE_NAME_RE.fullmatch(name):
        return None
    return (f"node name {name!r} may hold only letters, digits, '.', '_', ':' and '-' "
            "(starting with a letter, digit or '_'; at most 253 characters)")


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot be dialled as written, or None when it can."""
    if HOST_RE.fullmatch(host):
        return None
    return (f"host {host!r} may hold only letters, digits and '.', '_', ':', '%', '-', not starting with '.', '%' "
            "or '-' (a hostname or an address)")


def _node_name(value: str) -> str:
    problem = node_name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _host(value: str) -> str:
    problem = host_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError(f"{ascii(value)} holds a control character (a line break, tab or NUL)")
    return value


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError("holds a NUL character")
    return value


NodeName = Annotated[str, AfterValidator(_node_name)]
HostName = Annotated[str, AfterValidator(_host)]
Text = Annotated[str, AfterValidator(_printable)]
NoNul = Annotated[str, AfterValidator(_no_nul)]
# Per-chip TFLOPS: positive, finite and below TFLOPS_MAX (inf, NaN, 0 and negatives refused).
# strict: `true` is not 1.0.
Tflops = Annotated[float, Field(gt=0, le=TFLOPS_MAX, allow_inf_nan=False, strict=True)]
# A size or speed: zero or more, finite.
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]

"""Shell-safe rendering of the node scripts: every value is one quoted word on one line.

The node scripts are rendered by Jinja2 from data (plan, hosts, paths). Values
from outside (a model name, a node name, a chip model a node reports, a host,
a path) may hold anything, so the environment built here quotes *every*
``{{ … }}`` expression through :func:`word` in its ``finalize`` hook: the
template cannot forget. :func:`word` makes one shell word that stays on one
line: a plain printable value is single-quoted (:func:`shlex.quote`), and one
with a newline, a control character, a Unicode line separator or any other
unprintable character becomes an ANSI-C ``$'…'`` word whose bytes are ``\\xHH``
escapes. So a value can neither end a ``#`` comment nor leave its word in
code. NUL cannot be passed to a program at all and is refused.

Text that this package builds from quoted words (an ``env`` word list, a
``--flag value`` list) is marked :class:`Shell` and passes unchanged; lists
render as space-separated words.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from hetctl.errors import ConfigError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Shell(str):
    """Shell text assembled by hetctl from :func:`word`-quoted parts (rendered as is)."""


def _plain(ch: str) -> bool:
    return ch.isprintable() and ch not in "\\"


def word(value: object) -> str:
    """One shell word for ``value`` that occupies a single line.

    ``llama2-7b`` stays as it is, ``a b`` becomes ``'a b'``, and a newline
    makes ``$'x\\x0a$(id)'`` (the ``$(…)`` inert inside the quotes).

    Raises:
        ValueError: the value holds a NUL character (no shell word can carry it).
        UnicodeEncodeError: it holds a lone surrogate (not text).
    """
    text = str(value)
    if "\0" in text:
        raise ValueError(f"{text!r}: a NUL character cannot be passed to a program")
    if all(ch.isprintable() for ch in text):
        return shlex.quote(text)
    out = []
    for ch in text:
        if _plain(ch) and ch != "'":
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8"))
    return "$'" + "".join(out) + "'"


def words(values: Iterable[object], sep: str = " ") -> Shell:
    """Each value quoted by :func:`word`, joined by ``sep`` (which must be shell-inert)."""
    return Shell(sep.join(word(v) for v in values))


def assignment(name: str, value: object) -> Shell:
    """``NAME=value`` for ``env`` or a shell assignment, the name checked."""
    return Shell(f"{env_name(name)}={word(value)}")


def env_name(name: str, where: str = "environment variable") -> str:
    """``name`` when it is a valid environment variable name.

    Raises:
        ConfigError: it is not (it would be shell syntax where a name belongs).
    """
    if not ENV_NAME.match(name):
        raise ConfigError(f"{where} {name!r} is not a valid variable name",
                          "use letters, digits and _ only, not starting with a digit")
    return name


def finalize(value: object) -> str:
    """Jinja2 ``finalize``: :class:`Shell` as is, lists as words, everything else one :func:`word`."""
    if isinstance(value, Shell):
        return value
    if isinstance(value, (list, tuple)):
        return words(value)
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{value!r} reached a launch script template; render a string or a number")
    return word(value)


def check_script(text: str, name: str) -> str:
    """The rendered script, after checking that no raw control character slipped into it.

    :func:`finalize` makes this hold for every value; the check guards the
    templates themselves (a literal control character in a ``.j2`` file).
    """
    for i, ch in enumerate(text):
        if not (ch.isprintable() or ch in "\n\t"):
            line = text.count("\n", 0, i) + 1
            raise RuntimeError(f"{name}: line {line} holds the unprintable character {ch!r}")
    return text


def environment(package: str = "hetctl", folder: str = "templates"):
    """The Jinja2 environment of the launch scripts: every expression quoted by :func:`finalize`."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader(package, folder),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=finalize,
    )
    env.filters["commas"] = lambda values: words(values, ", ")
    return env

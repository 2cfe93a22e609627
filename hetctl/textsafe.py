"""Strings from outside shown as text, never as terminal control.

Chip names from vendor tools, hostnames, rank output and the error tails of nodes
reach the user's terminal. An ESC in one could clear the screen, retitle the window,
write the clipboard (OSC 52) or plant a hyperlink (OSC 8); a bidi override could make
a line read other than it is. :func:`clean` writes every such character as a visible
escape (``\\x1b``), keeping line breaks and tabs. The CLI's consoles apply it to every
piece of text they render (:class:`SafeConsole`), so no output path can forget it;
:func:`json_text` does the same for the characters JSON leaves as they are.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

# C0 controls but tab and line feed, DEL, C1 controls, and the bidi embeddings, overrides and isolates.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# What JSON may carry raw (it escapes only C0 itself).
_JSON_RAW = re.compile("[\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(m: re.Match) -> str:
    ch = m.group()
    return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"


def clean(text: str) -> str:
    """``text`` with every control character but tab and line feed written as a visible escape."""
    return _CONTROL.sub(_visible, text)


def json_text(text: str) -> str:
    """A JSON document with DEL, C1 controls and bidi controls written as ``\\uXXXX`` (still the same JSON)."""
    return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _console_class() -> type:
    from rich.console import Console
    from rich.segment import Segment

    class SafeConsole(Console):
        """A rich Console that cleans the text of every segment it renders; its own control
        segments (cursor moves of a live display) and the styles it renders pass unchanged."""

        def _render_buffer(self, buffer: Iterable[Segment]) -> str:
            return super()._render_buffer(
                seg if seg.control or not _CONTROL.search(seg.text) else Segment(clean(seg.text), seg.style)
                for seg in buffer)

    return SafeConsole


def safe_console(**kwargs: Any) -> Any:
    """A :class:`SafeConsole` (rich is imported only here, on first use)."""
    return _console_class()(**kwargs)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that stays valid JSON: a NaN or infinite number (a diverged loss) is ``null``,
    never the bare ``NaN`` that JSON parsers refuse."""
    import json

    return json.dumps(_finite(obj), allow_nan=False, **kwargs)

"""The agents' events, checked at the controller's edge: a node speaks only for itself.

An agent runs on a node hetctl does not control: its events are data from outside.
:func:`check` holds each one against the protocol of :mod:`hetctl.node.agent` (the
fields each ``ev`` carries, and their types) and against the plan (which ranks the
sending node holds). What fails becomes a :class:`Refused` reason, which the monitor
records as a ``bad_message`` warning event naming the sending node: never a crash of
the controller, and never a fault of another node. A node can still end or fail its
own ranks (a broken node is a fault of its own); it cannot speak for a peer's.

Strings the node sends (errors, reasons, log lines) pass unchanged here: they are
written to files as they are and made harmless where they are shown
(:mod:`hetctl.textsafe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection

from hetctl.node import protocol

STANDBY_STATES = frozenset({"importing", "ready", "used", "cold", "none", "gone"})
MAX_TEXT = 4096  # one error or reason; a longer one is cut (the rank's log keeps the whole output)
MAX_LINES = 10_000  # lines in one ``log`` event (the agent sends a fifth of a second's worth)
MAX_BATCH = 4096  # [rank, hb] pairs in one ``heartbeats`` event (one per rank of the node)


@dataclass(frozen=True)
class Refused:
    """Why one message of a node was not believed (one line, for the warning event)."""

    reason: str


@dataclass(frozen=True)
class Carried:
    """A node's agent stream ended with the stream that carried it (its relay was lost): ``reason`` says which.
    The node itself is not blamed (hetctl.remote.relay)."""

    reason: str


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any, finite: bool = True) -> bool:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    return ok and (not finite or math.isfinite(v))


def _opt(check: Any) -> Any:
    return lambda v: v is None or check(v)


def _text(v: Any) -> bool:
    return isinstance(v, str)


# ev → {field: (required, check)}; fields not named are ignored (a newer agent may add some).
_FIELDS: dict[str, dict[str, tuple[bool, Any]]] = {
    "hello": {},
    "started": {"rank": (True, _is_int), "pid": (False, _opt(_is_int))},
    "heartbeat": {"rank": (True, _is_int), "hb": (True, lambda v: isinstance(v, dict))},
    "heartbeats": {"hbs": (True, lambda v: isinstance(v, list) and len(v) <= MAX_BATCH and all(
        isinstance(x, list) and len(x) == 2 and _is_int(x[0]) and isinstance(x[1], dict) for x in v))},
    "log": {"rank": (True, _is_int), "dropped": (False, _opt(_is_int)),
            "lines": (False, lambda v: v is None or (isinstance(v, list) and len(v) <= MAX_LINES
                                                      and all(isinstance(x, str) for x in v)))},
    "alive": {"ranks": (True, lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()))},
    "standby": {"rank": (True, _is_int), "state": (True, lambda v: isinstance(v, str) and v in STANDBY_STATES),
                "pid": (False, _opt(_is_int)), "reason": (False, _opt(_text)),
                "import_s": (False, _opt(_is_num))},
    "exited": {"rank": (True, _is_int), "code": (False, _opt(_is_int)), "signal": (False, _opt(_is_int)),
               "error": (False, _opt(_text)), "oom": (False, _opt(lambda v: isinstance(v, bool)))},
    "stopped": {"reason": (False, _opt(_text)),
                "left": (False, _opt(lambda v: isinstance(v, list) and all(_is_int(p) for p in v)))},
    "error": {"message": (False, _opt(_text))},
}

# The heartbeat's own fields (hetctl.node.runtime) the controller reads; others are ignored.
# ``loss`` may be NaN or infinite (a diverged run is reported as such); times and speeds may not.
_HB_FIELDS: dict[str, Any] = {
    "step": lambda v: _is_int(v) and v >= 0,
    "loss": _opt(lambda v: _is_num(v, finite=False)),
    "first_loss": _opt(lambda v: _is_num(v, finite=False)),
    "step_ms": _opt(lambda v: _is_num(v) and v >= 0),
    "compute_ms": _opt(lambda v: _is_num(v) and v >= 0),
    "tokens_per_s": _opt(lambda v: _is_num(v) and v >= 0),
    "xv_bytes": _opt(lambda v: _is_int(v) and v >= 0),
    "xv_raw_bytes": _opt(lambda v: _is_int(v) and v >= 0),
    "time": _opt(_is_num),
    "phase": _opt(_text),
}

# Events about one rank: only the node that holds the rank may send them.
_RANKED = ("started", "heartbeat", "log", "exited")


def _shown(v: Any) -> str:
    """A field's value for the warning line: short, and never the whole of a flood."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check(msg: Any, owned: Collection[int]) -> protocol.Event | Refused:
    """``msg`` as the monitor may use it (one of :data:`hetctl.node.protocol.EVENTS`' shapes, which
    :data:`_FIELDS` checks), or why it was refused.

    Args:
        msg: one decoded line of the agent's stdout.
        owned: the ranks the plan puts on the sending node.

    Returns:
        The message, with over-long strings cut to :data:`MAX_TEXT`; or a :class:`Refused`.
    """
    if not isinstance(msg, dict):
        return Refused(f"not a JSON object: {_shown(msg)}")
    ev = msg.get("ev")
    fields = _FIELDS.get(ev) if isinstance(ev, str) else None
    if fields is None:
        return Refused(f"unknown event {_shown(ev)}")
    if "t" in msg and not _opt(_is_num)(msg["t"]):
        return Refused(f"{ev}: field t is {_shown(msg['t'])}, not a time")
    for name, (required, ok) in fields.items():
        if name not in msg:
            if required:
                return Refused(f"{ev}: field {name} missing")
            continue
        if not ok(msg[name]):
            return Refused(f"{ev}: field {name} is {_shown(msg[name])}")
    if ev in _RANKED and msg["rank"] not in owned:
        return Refused(f"{ev} for rank {msg['rank']}, which the plan puts on another node")
    for rank, hb in ([(msg["rank"], msg["hb"])] if ev == "heartbeat" else msg["hbs"] if ev == "heartbeats" else ()):
        if ev == "heartbeats" and rank not in owned:
            return Refused(f"heartbeats for rank {rank}, which the plan puts on another node")
        for name, ok in _HB_FIELDS.items():
            if name in hb and not ok(hb[name]):
                return Refused(f"heartbeat of rank {rank}: {name} is {_shown(hb[name])}")
    if ev == "alive":
        foreign = [r for r in msg["ranks"] if not (isinstance(r, str) and r.isascii() and r.isdigit() and int(r) in owned)]
        if foreign:
            return Refused(f"alive names rank {', '.join(map(_shown, foreign[:3]))}, which the plan puts "
                           "on another node")
    return {k: (v[:MAX_TEXT] if isinstance(v, str) else v) for k, v in msg.items()}  # type: ignore[return-value]


MAX_LINE = 4 << 20  # bytes of one event line (hetctl.launch.reader); the agent's log budget keeps real ones far below


# The pre-flight's answer (hetctl.node.preflight): field → check; the controller reads these.
_PREFLIGHT: dict[str, Any] = {
    "workdir": lambda v: isinstance(v, str) and v.startswith("/") and "\0" not in v,
    "writable": lambda v: isinstance(v, bool),
    "unsafe": _opt(_text),
    "error": _opt(_text),
    "share_id": _opt(lambda v: isinstance(v, str) and v.isalnum()),
    "agent_ok": _opt(lambda v: isinstance(v, bool)),
    "modules": lambda v: isinstance(v, dict) and all(isinstance(x, bool) for x in v.values()),
    "versions": _opt(lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "port": _opt(lambda v: _is_int(v) and 0 < v < 65536),
}


def preflight_problem(info: dict) -> str | None:
    """What is wrong with a node's pre-flight answer (one line), or None when each field the
    controller reads has its type: a node's answer names its own workdir and port, nothing more."""
    for name, ok in _PREFLIGHT.items():
        if name in ("workdir", "writable", "modules") and name not in info:
            return f"the pre-flight's answer lacks {name}"
        if name in info and not ok(info[name]):
            return f"the pre-flight's answer has {name} = {_shown(info[name])}"
    return None

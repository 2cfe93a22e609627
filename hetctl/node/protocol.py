"""The agent's protocol as types: what it reads on stdin and writes on stdout (:mod:`hetctl.node.agent`).

Standard library only, like all of ``hetctl/node/``, and importable by the oldest python a node may have
(``total=False`` classes, not ``NotRequired``). The controller holds every event it reads to these shapes
at its edge (:func:`hetctl.launch.wire.check`, whose field table a test keeps equal to them) and then
handles it by ``ev`` (:class:`hetctl.launch.monitor.Monitor`). Every event also carries ``t``, the node's
clock when it was written.
"""

from __future__ import annotations

from typing import Dict, List, Optional, TypedDict, Union


# -- controller → agent (stdin) --------------------------------------------------------------------------
class _RankSpec(TypedDict):
    rank: int
    argv: List[str]
    env: Dict[str, str]


class RankSpec(_RankSpec, total=False):
    cwd: str
    log: str
    heartbeat: str
    progress: Optional[str]


class _StartCmd(TypedDict):
    cmd: str  # "start"
    ranks: List[RankSpec]


class StartCmd(_StartCmd, total=False):
    grace_s: float
    standby: bool


class _StopCmd(TypedDict):
    cmd: str  # "stop"


class StopCmd(_StopCmd, total=False):
    keep: bool


class PortCmd(TypedDict):
    cmd: str  # "port"


Command = Union[StartCmd, StopCmd, PortCmd]


# -- agent → controller (stdout) -------------------------------------------------------------------------
class Hello(TypedDict):
    ev: str  # "hello"


class _Started(TypedDict):
    ev: str  # "started"
    rank: int


class Started(_Started, total=False):
    pid: Optional[int]


class Heartbeat(TypedDict):
    ev: str  # "heartbeat"
    rank: int
    hb: dict  # the rank's heartbeat file (hetctl.node.runtime.write_heartbeat): step, loss, step_ms, …


class Heartbeats(TypedDict):
    """What one poll found new for several ranks of the node: ``[rank, hb]`` pairs."""

    ev: str  # "heartbeats"
    hbs: List[list]


class _Log(TypedDict):
    ev: str  # "log"
    rank: int


class Log(_Log, total=False):
    lines: Optional[List[str]]
    dropped: Optional[int]


class Alive(TypedDict):
    """Every second: each rank's process state letter (R, S, T, …; X once exited)."""

    ev: str  # "alive"
    ranks: Dict[str, str]


class _StandbyEvent(TypedDict):
    ev: str  # "standby"
    rank: int
    state: str  # importing, ready, used, cold, none, gone


class StandbyEvent(_StandbyEvent, total=False):
    pid: Optional[int]
    reason: Optional[str]
    import_s: Optional[float]


class _Exited(TypedDict):
    ev: str  # "exited"
    rank: int


class Exited(_Exited, total=False):
    code: Optional[int]
    signal: Optional[int]
    error: Optional[str]
    oom: Optional[bool]


class _Stopped(TypedDict):
    ev: str  # "stopped"


class Stopped(_Stopped, total=False):
    reason: Optional[str]
    left: Optional[List[int]]


class _Error(TypedDict):
    ev: str  # "error"


class Error(_Error, total=False):
    message: Optional[str]


class Port(TypedDict):
    """The answer to ``port`` (read by the connection, never queued as an attempt's event)."""

    ev: str  # "port"
    port: int


Event = Union[Hello, Started, Heartbeat, Heartbeats, Log, Alive, StandbyEvent, Exited, Stopped, Error]
"""An event of an attempt, as :func:`hetctl.launch.wire.check` lets it through."""

EVENTS: Dict[str, type] = {"hello": Hello, "started": Started, "heartbeat": Heartbeat, "heartbeats": Heartbeats,
                           "log": Log, "alive": Alive, "standby": StandbyEvent, "exited": Exited,
                           "stopped": Stopped, "error": Error}
"""``ev`` → its type: every event an attempt's monitor handles."""

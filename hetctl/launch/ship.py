"""Ship an attempt's files (the agent zipapp, ``plan.json``) to its nodes: once per folder they share.

Nodes whose pre-flight reported the same workdir path and the same share id
(:func:`hetctl.node.preflight.share_id`) see one folder, an NFS home on most
clusters. The first of them in plan order gets the files; the others then check,
with one small command each, that they see them with the right digests, and get
a copy only when they do not (a cloned disk image carries the share id without
sharing the folder). The agent file is content-addressed, so a node that already
has it with the right digest (an earlier launch) gets it from nobody.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Mapping, Sequence

from hetctl.errors import HetctlError
from hetctl.launch import materialize as mat

Fanout = Callable[[list[Any], Callable[[Any], Any]], dict[str, Any]]


def share_groups(names: Sequence[str], preflight: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """``names`` grouped by the folder they see, each group in the order given; a node without a share id alone."""
    groups: dict[Any, list[str]] = {}
    for n in names:
        info = preflight.get(n, {})
        sid = info.get("share_id")
        key = (sid, info.get("workdir")) if sid else ("alone", n)
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def ship(nodes: Sequence[Any], transports: Mapping[str, Any], launches: Mapping[str, mat.NodeLaunch],
         preflight: Mapping[str, Mapping[str, Any]], plan_bytes: bytes, fanout: Fanout,
         ) -> tuple[dict[str, BaseException], dict[str, list[str]]]:
    """Write the agent and the plan where each node will read them.

    Args:
        nodes: the plan's inventory nodes, in plan order.
        transports: node name → its open transport.
        launches: node name → its :class:`hetctl.launch.materialize.NodeLaunch` (the paths).
        preflight: node name → its pre-flight report (``share_id``, ``workdir``, ``agent_ok``).
        plan_bytes: the plan as the ranks read it.
        fanout: runs a function per node at bounded width; node name → value or exception.

    Returns:
        (node → the exception that stopped its shipping, node → the files written to it:
        ``agent``, ``plan``).
    """
    zipapp = mat.agent_zipapp()
    digests = {"agent": mat.agent_zipapp_sha256(), "plan": hashlib.sha256(plan_bytes).hexdigest()}
    payload = {"agent": zipapp, "plan": plan_bytes}
    by_name = {n.name: n for n in nodes}
    groups = share_groups([n.name for n in nodes], preflight)
    written: dict[str, list[str]] = {}

    def paths(name: str) -> dict[str, str]:
        nl = launches[name]
        return {"agent": nl.agent_argv[1], "plan": nl.plan_path}

    def put(name: str, what: Sequence[str]) -> None:
        t = transports[name]
        for key in what:
            t.put(payload[key], paths(name)[key], mode=0o644)
        written[name] = list(what)

    def lead(node: Any) -> None:
        put(node.name, [k for k in ("agent", "plan") if not (k == "agent" and preflight[node.name].get("agent_ok"))])

    def follow(node: Any) -> None:
        files = paths(node.name)
        res = transports[node.name].run(mat.have_argv(node.python, {files[k]: digests[k] for k in files}),
                                        env=node.env or None, timeout=60, check=False)
        report = mat.parse_preflight(res.stdout)
        if report is None or not isinstance(report.get("missing"), list):
            raise HetctlError(f"cannot check the shipped files: {(res.stderr or '').strip()[-200:] or res.exit_code}")
        gone = set(report["missing"])
        if gone:
            put(node.name, [k for k in files if files[k] in gone])
        else:
            written[node.name] = []

    failed: dict[str, BaseException] = {}
    leaders = [by_name[g[0]] for g in groups]
    for name, v in fanout(leaders, lead).items():
        if isinstance(v, BaseException):
            failed[name] = v
    followers = [by_name[n] for g in groups for n in g[1:]]
    if followers:
        for name, v in fanout(followers, follow).items():
            if isinstance(v, BaseException):
                failed[name] = v
    return failed, written

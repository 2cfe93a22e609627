"""What Slurm says about an allocation and its nodes (``scontrol``/``squeue``/``sinfo``), asked now.

The Slurm client commands run as argument lists, and every failure becomes a
one-line :class:`~hetctl.errors.HetctlError` that says what to do; their output is
parsed by the pure functions of :mod:`hetctl.remote.slurmparse`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import replace
from typing import Mapping, Sequence

from hetctl.errors import HetctlError
from hetctl.remote.slurmparse import HetPlace, SlurmJob, SlurmNode, given, parse_job, parse_jobs, parse_nodes, parse_topology

QUERY_TIMEOUT_S = 30.0


def _client(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise HetctlError(f"{tool} not found on PATH: hetctl needs the Slurm client commands for `slurm:`",
                          "run hetctl on a login node of the cluster or install them (Debian: apt-get install slurm-client)")
    return path


def client(tool: str) -> str:
    """The path of a Slurm client command (``salloc``, ``scancel`` …), or a one-line error saying what to install."""
    return _client(tool)


def query(argv: Sequence[str], what: str, timeout: float = QUERY_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a Slurm client command (its output as text); a one-line error when it is missing or does not answer."""
    try:
        return subprocess.run([_client(argv[0]), *argv[1:]], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HetctlError(f"{what}: `{argv[0]}` did not answer in {timeout:g} s",
                          "check that slurmctld is up: scontrol ping") from None


def last_line(r: subprocess.CompletedProcess) -> str:
    """What a failed command said last (its exit code when it said nothing)."""
    lines = [ln.strip() for ln in (r.stderr or r.stdout or "").splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {r.returncode}"


def show_jobs(job: str) -> list[SlurmJob]:
    """The running records of ``job``: the job itself, or the running components of a heterogeneous job.

    Slurm answers a heterogeneous job's leader id with every component, a
    component's own id (or ``J+K``) with that component only. A component that
    ended (a node failure ends every other component of one node, even with
    ``--no-kill``) is left out while another one runs. A one-line error when Slurm
    does not know the job or no part of it runs.
    """
    r = query(["scontrol", "show", "job", "-o", job], f"Slurm job {job}")
    parts = parse_jobs(r.stdout) if r.returncode == 0 else []
    if not parts:
        raise HetctlError(f"Slurm job {job} not found: {last_line(r)}",
                          "run hetctl inside a live allocation (salloc/sbatch) or fix slurm.job in the inventory")
    running = [p for p in parts if p.state == "RUNNING"]
    if not running:
        states = ", ".join(dict.fromkeys(p.state or "not running" for p in parts))
        raise HetctlError(f"Slurm job {job} is {states}, not RUNNING",
                          "wait for it to start (squeue -j " + job + ") or ask for a new allocation")
    return running


def show_job(job: str) -> SlurmJob:
    """The job ``job`` (a heterogeneous job's first running component); a one-line error when Slurm does not
    know it or it is not running."""
    return show_jobs(job)[0]


def hostnames(node_list: str) -> list[str]:
    """``scontrol show hostnames LIST`` (Slurm's own expansion of ``n[1-3,5]``)."""
    r = query(["scontrol", "show", "hostnames", node_list], "expanding the node list")
    if r.returncode != 0:
        raise HetctlError(f"cannot expand the Slurm node list {node_list!r}: {last_line(r)}")
    return [h for h in r.stdout.split() if h]


def topology_switches() -> dict[str, str]:
    """Node → its leaf switch or block, from the cluster's Slurm topology; empty when Slurm has none.

    Only a label for the planner (``switch``): a Slurm without a topology plugin
    ("No topology information available") or a failing query gives no labels,
    never an error.
    """
    try:
        r = query(["scontrol", "show", "topology"], "reading the Slurm topology")
    except HetctlError:
        return {}
    return parse_topology(r.stdout) if r.returncode == 0 else {}


def show_nodes(names: Sequence[str]) -> list[SlurmNode]:
    """The nodes ``names`` in that order."""
    r = query(["scontrol", "show", "node", "-o", ",".join(names)], "reading the Slurm nodes")
    if r.returncode != 0:
        raise HetctlError(f"cannot read Slurm nodes {','.join(names)}: {last_line(r)}")
    by_name = {n.name: n for n in parse_nodes(r.stdout)}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise HetctlError(f"Slurm knows no node {missing[0]!r}")
    return [by_name[n] for n in names]


def current_job() -> str | None:
    """``SLURM_JOB_ID`` of the allocation hetctl runs in (None outside one)."""
    return os.environ.get("SLURM_JOB_ID") or None


def job_nodes(job: str) -> list[SlurmNode]:
    """The nodes of the running job ``job``, with their Gres, features, CPUs and memory.

    Inside that job's own allocation ``SLURM_JOB_NODELIST`` gives the list without
    asking slurmctld; otherwise the job's ``NodeList``. A heterogeneous job
    (``SLURM_HET_SIZE`` set, or several records) is always asked about: there
    ``SLURM_JOB_NODELIST`` is unset (salloc) or names component 0 only (sbatch).
    Its nodes are those of every running component, in component order, each with
    its :class:`HetPlace` (a node in two components: the first).
    """
    node_list = None
    if current_job() == job and not os.environ.get("SLURM_HET_SIZE"):
        node_list = os.environ.get("SLURM_JOB_NODELIST")
    place: dict[str, HetPlace | None] = {}
    if node_list:
        names = hostnames(node_list)
    else:
        names = []
        for part in show_jobs(job):
            for name in hostnames(part.node_list) if part.node_list else []:
                if name not in place:
                    place[name] = part.het
                    names.append(name)
    if not names:
        raise HetctlError(f"Slurm job {job} holds no nodes")
    return [replace(n, het=place.get(n.name)) for n in show_nodes(names)]


def env_het_place(name: str, environ=os.environ) -> HetPlace | None:
    """The component of the heterogeneous allocation hetctl runs in that holds node ``name``, from the
    variables salloc/sbatch set (``SLURM_HET_SIZE``, ``SLURM_JOB_NODELIST_HET_GROUP_<n>``,
    ``SLURM_JOB_ID_HET_GROUP_<n>``); None in a plain allocation or when no component lists the node."""
    import hostlist

    try:
        size = int(environ.get("SLURM_HET_SIZE", "0"))
    except ValueError:
        return None
    leader = environ.get("SLURM_JOB_ID", "")
    for group in range(size if leader else 0):
        try:
            names = hostlist.expand_hostlist(environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{group}", ""))
        except (hostlist.BadHostlist, ValueError):
            continue
        if name in names:
            return HetPlace(leader, group, environ.get(f"SLURM_JOB_ID_HET_GROUP_{group}", "") or leader)
    return None


def node_state(name: str) -> SlurmNode | None:
    """The node as slurmctld sees it now (state ``IDLE``, ``DOWN*``, ``MIXED+DRAIN`` …); None when unknown."""
    try:
        nodes = show_nodes([name])
    except HetctlError:
        return None
    return nodes[0] if nodes else None


def slurmd_timeout(default: float = 300.0) -> float:
    """slurmctld's ``SlurmdTimeout`` in seconds (how long a silent node may stay up), ``default`` when unknown."""
    try:
        r = query(["scontrol", "show", "config"], "reading the Slurm configuration")
    except HetctlError:
        return default
    m = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", r.stdout or "", re.M)
    return float(m.group(1)) if m else default


def confirm_lost(names: Sequence[str], within_s: float, poll_s: float = 0.5, *, show=None, clock=time.monotonic,
                 sleep=time.sleep, until_down: bool = False) -> dict[str, SlurmNode | None]:
    """Ask slurmctld about ``names`` until each is in a lost state or ``within_s`` passed.

    slurmctld marks a node that stops answering NOT_RESPONDING at its next ping and
    DOWN after ``SlurmdTimeout``, so a node that died a moment ago still reads
    healthy: the answer is polled, never taken once. ``until_down``: NOT_RESPONDING
    alone does not end the wait (a heterogeneous job: Slurm ends the job's other
    components only when it marks the node DOWN). Returns name → the node as Slurm
    last described it (``.lost`` says the verdict); None when Slurm could not be
    asked at all (then the caller keeps what it saw itself).
    """
    show = show or show_nodes
    names = list(dict.fromkeys(names))
    seen: dict[str, SlurmNode | None] = {n: None for n in names}
    deadline = clock() + within_s

    def done(n: str) -> bool:
        node = seen[n]
        return node is not None and (node.down if until_down else node.lost)

    while True:
        pending = [n for n in names if not done(n)]
        if not pending:
            return seen
        try:
            for node in show(pending):
                seen[node.name] = node
        except HetctlError:
            pass
        if all(done(n) for n in pending) or clock() >= deadline:
            return seen
        sleep(poll_s)


def ended_components(places: Mapping[str, HetPlace], run=None) -> dict[str, str]:
    """Slurm's word on each node whose heterogeneous-job component no longer runs (node → words).

    When a node fails, Slurm ends every other component of the job that holds a
    single node, even with ``--no-kill`` (slurmctld's ``_het_job_on_node`` counts
    the whole job as on the failed node; a component of several nodes only drops
    the failed one): such a node reads IDLE, yet no step can start there any more.
    A component Slurm cannot be asked about is left out.
    """
    run = run or query
    out: dict[str, str] = {}
    for component in dict.fromkeys(p.component for p in places.values()):
        try:
            r = run(["scontrol", "show", "job", "-o", component], f"Slurm job {component}")
        except HetctlError:
            continue
        info = parse_job(r.stdout) if r.returncode == 0 else None
        if info is None:
            if "Invalid job id" not in (r.stderr or ""):
                continue  # not an answer about the job
            state, reason = "gone", ""
        elif info.state in ("RUNNING", "SUSPENDED"):
            continue
        else:
            state, reason = info.state, given(info.extra.get("Reason", "")).replace("None", "")
        for node, place in places.items():
            if place.component == component:
                out[node] = f"slurm: {node}'s job component {place.label} is {state}" + (f" ({reason})" if reason else "")
    return out


def check_plan_fits(plan_nodes: Sequence[str], inventory) -> None:
    """A one-line error when a plan needs nodes the Slurm allocation does not hold.

    Args:
        plan_nodes: the node of every rank of the plan.
        inventory: the loaded inventory (its ``slurm`` nodes carry ``slurm_job``).
    """
    have = {n.name for n in inventory.nodes}
    want = list(dict.fromkeys(plan_nodes))
    missing = [n for n in want if n not in have]
    if not missing:
        return
    jobs = sorted({n.slurm_job for n in inventory.nodes if n.transport == "slurm" and n.slurm_job})
    where = f"Slurm job {', '.join(jobs)}" if jobs else "the inventory"
    held = ",".join(n.name for n in inventory.nodes) or "none"
    raise HetctlError(
        f"the plan needs {len(want)} node(s) ({','.join(want)}) but {where} holds {len(have)} ({held}); "
        f"missing: {','.join(missing)}",
        f"ask for an allocation with those nodes (salloc -w {','.join(want)}) or probe and plan again inside this one",
    )

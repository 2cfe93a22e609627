"""The inventory file (``-i inventory.yaml``): which nodes exist and how to reach them.

Two layers of models: the *file* models (:class:`InventoryFile`, :class:`NodeEntry`)
mirror what the user writes; :func:`load_inventory` turns them into the resolved
:class:`Inventory`, whose :class:`Node` list is expanded and complete, so that no
other module has to know about ranges, defaults or ``~/.ssh/config``.

Resolution rules (docs/inventory.md repeats them):

* ``host`` accepts hostlist ranges (``gpu-[01-16]``, ``10.0.0.[1-4],login``), expanded
  with ``python-hostlist``. ``name`` (default: the host) expands the same way and is
  zipped with the hosts in order, so ``name: node-[1-4]`` with ``host: 10.0.0.[11-14]``
  gives ``node-1 → 10.0.0.11`` … A range in ``host`` needs a range of the same length
  in ``name`` when ``name`` is set. Names must be unique across the file.
* Every node key except ``host`` and ``name`` may also be set under ``defaults:``; a
  node's own value wins. ``env`` and ``labels`` are merged key by key.
* For ``transport: ssh`` nodes, the system's OpenSSH client does the resolving: a
  value written in the inventory (on the node or in ``defaults``) is passed to ``ssh``
  as an option and wins; what it leaves unset (``None`` here) stays with the user's
  ssh_config (``HostName``, ``User``, ``Port``, ``IdentityFile``, ``ProxyJump`` …), then
  ssh's own defaults. :func:`hetctl.remote.sshconfig.effective_settings` shows the result.
* Local paths (``identity_file``, ``ssh.config``, ``ssh.known_hosts``) expand ``~``
  on this machine; relative ones are relative to the inventory file's folder.
* ``workdir`` (default ``~/.hetctl``) is a path *on the node*: for ssh nodes ``~`` is
  kept and expanded by the node's shell (``$HOME``), and a relative path means
  ``~/<path>``; for local nodes ``~`` expands here and a relative path is relative to
  the inventory file's folder, so ``inventories/local.yaml`` works from any cwd.
* ``checkpoint_dir`` must be absolute (or start with ``~``) unless every node is local,
  in which case a relative path is relative to the inventory file's folder.
* ``slurm:`` adds the nodes of a Slurm allocation (before any listed ``nodes:``):
  the job ``slurm.job``, else the one hetctl runs in (``SLURM_JOB_ID``). Each gets
  ``transport: slurm``, ``hostname`` = Slurm's ``NodeAddr``, the ``defaults:`` and
  the labels ``slurm_gres``, ``slurm_features``, ``slurm_cpus``, ``slurm_memory_mb``,
  and ``switch``: the leaf switch (or block) Slurm's topology puts the node under
  (``scontrol show topology``, from ``topology.conf``), unless ``defaults: labels: switch:``
  says otherwise. In a heterogeneous job (``salloc … : …``) the nodes of every component,
  each with its component (``slurm_het_group``), and ``slurm_job`` = the job's leader.
  Slurm is asked by the caller's ``slurm=`` function (:func:`hetctl.remote.slurmalloc.allocation`),
  which returns a :class:`hetctl.files.allocation.Allocation`; this module runs no command.
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BeforeValidator, Field, StringConstraints, ValidationError, model_validator

from hetctl.files.fields import Strict as _Strict

from hetctl.errors import ConfigError, HetctlError
from hetctl.files.allocation import Allocation, AllocationError
from hetctl.files.fields import NoNul, Text, Tflops, host_problem, node_name_problem
from hetctl.files.hostrange import MAX_NODES, count_hostlist
from hetctl.files.yamlio import _line_of, format_loc, located_error, read_yaml, validation_error

DEFAULT_WORKDIR = "~/.hetctl"
DEFAULT_SSH_CONFIG = "~/.ssh/config"  # kept as written: ssh reads it (and the system file) itself


def _scalar_to_str(value: Any) -> Any:
    """Accept numbers where a string is expected (``OMP_NUM_THREADS: 4``); refuse booleans."""
    if isinstance(value, bool):
        raise ValueError("booleans are ambiguous here; write a quoted string such as '1' or 'true'")
    if isinstance(value, (int, float)):
        return str(value)
    return value


Scalar = Annotated[NoNul, BeforeValidator(_scalar_to_str)]
Label = Annotated[Text, BeforeValidator(_scalar_to_str)]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
TransportName = Literal["ssh", "local", "slurm"]


class SshSettings(_Strict):
    """The ``ssh:`` block. After loading, paths are absolute (or ``None``)."""

    config: Text | None = Field(
        default=DEFAULT_SSH_CONFIG,
        description="OpenSSH client config to honour (default: what ssh reads itself); null to read none",
    )
    known_hosts: Text | None = Field(
        default=None, description="host keys to verify against, added (first) to the user's UserKnownHostsFile list"
    )
    host_key_policy: Literal["strict", "accept-new"] | None = Field(
        default=None,
        description="StrictHostKeyChecking yes / accept-new (unset: ssh_config, else strict). Changed keys are always refused.",
    )
    connect_timeout: float | None = Field(
        default=None, gt=0, le=3600, allow_inf_nan=False, strict=True,
        description="ConnectTimeout in seconds (unset: ssh_config, else 10)",
    )
    keepalive: float | None = Field(
        default=None, ge=0, le=3600, allow_inf_nan=False, strict=True,
        description="ServerAliveInterval in seconds, 0 off (unset: ssh_config, else 5)",
    )
    fanout: int = Field(default=64, ge=1, le=4096, strict=True, description="how many nodes are contacted at once")
    relay_above: int | None = Field(
        default=None, ge=1, strict=True,
        description="past this many nodes, the agents' sessions go through relay nodes (about √N); unset: never")


class NodeDefaults(_Strict):
    """Keys allowed under ``defaults:`` and on every node (where the node's value wins)."""

    user: Text | None = None
    port: int | None = Field(default=None, ge=1, le=65535, strict=True)  # strict: `port: true` is not port 1
    identity_file: Text | None = None
    proxy_jump: Text | None = Field(default=None, description="like ssh -J; 'none' disables the ssh config's ProxyJump")
    python: Text | None = None
    workdir: Text | None = None
    env: dict[EnvName, Scalar] | None = None
    labels: dict[Text, Label] | None = None
    transport: TransportName | None = None
    tflops: Tflops | None = Field(default=None, description="per-chip TFLOPS; wins over spec and measurement")


class NodeEntry(NodeDefaults):
    """One item of ``nodes:`` as written; ``host`` and ``name`` may hold ranges."""

    host: Text = Field(min_length=1)
    name: Text | None = None


class SlurmSettings(_Strict):
    """The ``slurm:`` block: take nodes from a Slurm allocation (``slurm: {}`` = the job hetctl runs in)."""

    job: str | None = Field(default=None, description="job id to use; default: SLURM_JOB_ID of the allocation hetctl runs in")
    partition: str | None = Field(default=None, description="outside an allocation: the partition to ask")
    features: list[str] = Field(default_factory=list, description="node features every node must have (-C)")
    gres: str | None = Field(default=None, description="generic resources per node, e.g. gpu:8")
    nodes: int | None = Field(default=None, ge=1, description="how many nodes to ask for")
    steps: Literal["component", "node"] = Field(
        default="component",
        description="the agents' srun steps: one per het component (or job), or one per node (each node's env its own)")

    @model_validator(mode="before")
    @classmethod
    def _job_as_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("job"), int) and not isinstance(data.get("job"), bool):
            data = {**data, "job": str(data["job"])}
        return data


# Asks Slurm what the job a `slurm:` block names holds (hetctl.remote.slurmalloc.allocation); raises
# AllocationError (located below `slurm:`) or HetctlError.
AskSlurm = Callable[[SlurmSettings], Allocation]


class InventoryFile(_Strict):
    """The inventory file as written."""

    kind: Literal["inventory"] | None = Field(default=None, description="which hetctl file this is; optional here")
    defaults: NodeDefaults = Field(default_factory=NodeDefaults)
    ssh: SshSettings = Field(default_factory=SshSettings)
    checkpoint_dir: Text | None = None
    slurm: SlurmSettings | None = None
    nodes: list[NodeEntry] = Field(min_length=1)
    public_env: list[EnvName] = Field(default_factory=list, description="env names whose values --dry-run may "
                                      "show; every other env value is printed as ***")

    @model_validator(mode="before")
    @classmethod
    def _nodes_optional_with_slurm(cls, data: Any) -> Any:
        """With ``slurm:`` the nodes come from the allocation, so ``nodes:`` may be absent."""
        if isinstance(data, dict) and "slurm" in data and data["slurm"] is None:
            data = {**data, "slurm": {}}  # a bare `slurm:` means the same as `slurm: {}`
        if isinstance(data, dict) and data.get("slurm") is not None and not data.get("nodes"):
            data = {**data, "nodes": [{"host": "<slurm>"}]}  # placeholder, dropped by the resolver
        return data


class Node(_Strict):
    """One node, fully resolved: what a transport needs and what the planner labels.

    ``host`` is the name as written in the inventory (after range expansion), the
    destination given to ``ssh``; ``hostname`` starts as ``host`` (the address that
    ssh_config's ``HostName`` may change: the transport's ``effective`` settings have
    the dialled one). For ssh nodes ``user``, ``port``, ``identity_file`` and
    ``proxy_jump`` hold what the inventory sets (``None``: left to ssh_config);
    ``proxy_jump: none`` disables the config's ProxyJump.
    """

    name: str
    host: str
    hostname: str = ""
    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity_file: str | None = None
    proxy_jump: str | None = None
    python: str = "python3"
    workdir: str = DEFAULT_WORKDIR
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    transport: TransportName = "ssh"
    tflops: float | None = None
    slurm_job: str | None = None
    slurm_het_group: int | None = None  # a heterogeneous job's component holding the node (srun --het-group)
    slurm_het_component: str | None = None  # that component's own job id (its steps are listed under it)

    @model_validator(mode="after")
    def _fill_hostname(self) -> Node:
        if not self.hostname:
            self.hostname = self.host
        return self


class Inventory(_Strict):
    """The resolved inventory: every node expanded and complete."""

    source: Path | None = None
    defaults: NodeDefaults = Field(default_factory=NodeDefaults)
    ssh: SshSettings = Field(default_factory=SshSettings)
    checkpoint_dir: str | None = None
    nodes: list[Node] = Field(default_factory=list)
    slurm: SlurmSettings | None = None
    public_env: list[str] = Field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Node names in file order."""
        return [n.name for n in self.nodes]

    def node(self, name: str) -> Node:
        """The node called ``name``; a ConfigError naming it (and the file) otherwise."""
        for n in self.nodes:
            if n.name == name:
                return n
        where = f"{self.source}: " if self.source else ""
        known = ", ".join(self.names) or "none"
        raise ConfigError(f"{where}no node named {name!r}", f"known nodes: {known}")


# --- loading ---------------------------------------------------------------------


class _LocatedError(Exception):
    """A resolution problem with its key path, turned into a ConfigError by the loader."""

    def __init__(self, loc: tuple[Any, ...], msg: str, hint: str | None = None) -> None:
        super().__init__(msg)
        self.loc, self.msg, self.hint = loc, msg, hint


def _local_path(value: str, base: Path) -> str:
    """Expand ``~`` here and anchor relative paths at the inventory's folder."""
    p = Path(os.path.expanduser(value))
    return str(p if p.is_absolute() else (base / p).resolve())


def _node_workdir(value: str, transport: str, base: Path, loc: tuple[Any, ...]) -> str:
    if value.startswith("~") and not (value == "~" or value.startswith("~/")):
        raise _LocatedError(loc, f"'{value}': only '~' and '~/…' are understood", "write an absolute path")
    if transport == "local":
        return _local_path(value, base)
    if value.startswith("~") or value.startswith("/"):
        return value
    return "~/" + value


def _expand(pattern: str, loc: tuple[Any, ...]) -> list[str]:
    import hostlist

    try:
        out = hostlist.expand_hostlist(pattern)
    except (hostlist.BadHostlist, ValueError) as e:
        raise _LocatedError(loc, f"bad host range {pattern!r}: {e}", "write ranges like gpu-[01-16] or 10.0.0.[1-4]") from None
    if not out:
        raise _LocatedError(loc, f"{pattern!r} names no host")
    return out


def _resolve_nodes(f: InventoryFile, base: Path, slurm_job: str | None = None) -> list[Node]:
    defaults = f.defaults.model_dump(exclude_none=True)
    nodes: list[Node] = []
    first_seen: dict[str, tuple[Any, ...]] = {}
    total = 0
    for i, entry in enumerate(f.nodes):
        if f.slurm is not None and entry.host == "<slurm>":
            continue
        total += max(count_hostlist(entry.host), count_hostlist(entry.name or ""))
        if total > MAX_NODES:
            raise _LocatedError(
                ("nodes", i, "host"),
                f"the ranges up to here name {total:,} nodes; an inventory may list at most {MAX_NODES:,}",
                "check the ranges for a typo such as [1-10000] for [1-100]",
            )
        own = entry.model_dump(exclude_none=True, exclude={"host", "name"})
        merged = {**defaults, **own}
        for key in ("env", "labels"):
            merged[key] = {**defaults.get(key, {}), **own.get(key, {})}
        transport = merged.pop("transport", "ssh")
        hosts = _expand(entry.host, ("nodes", i, "host"))
        if entry.name is None:
            names = hosts
        else:
            names = _expand(entry.name, ("nodes", i, "name"))
            if len(names) != len(hosts):
                raise _LocatedError(
                    ("nodes", i, "name"),
                    f"{entry.name!r} gives {len(names)} name(s) for {len(hosts)} host(s) in {entry.host!r}",
                    "give name a range of the same length, e.g. name: node-[1-4]",
                )
        name_loc = ("nodes", i, "name" if entry.name is not None else "host")
        if "identity_file" in merged:
            merged["identity_file"] = _local_path(merged["identity_file"], base)
        workdir = _node_workdir(merged.pop("workdir", DEFAULT_WORKDIR), transport, base, ("nodes", i, "workdir"))
        for name, host in zip(names, hosts):
            for problem, loc in ((node_name_problem(name), name_loc), (host_problem(host), ("nodes", i, "host"))):
                if problem:
                    raise _LocatedError(loc, problem, "node names and hosts must be hostnames or addresses")
            if name in first_seen:
                raise _LocatedError(
                    name_loc,
                    f"duplicate node {name!r} (also at {format_loc(first_seen[name])})",
                    "each node may appear once; check overlapping ranges",
                )
            first_seen[name] = name_loc
            fields = dict(merged)
            if transport == "slurm":
                fields.update(slurm_job=slurm_job)
            if transport == "ssh":
                fields["hostname"] = host
            else:
                # A local node runs as whoever runs hetctl; ssh coordinates do not apply.
                fields.update(hostname=host, user=getpass.getuser(), port=22, identity_file=None, proxy_jump=None)
            try:
                nodes.append(Node(name=name, host=host, transport=transport, workdir=workdir, **fields))
            except ValidationError as e:  # a merged value the file models let through
                first = e.errors()[0]
                raise _LocatedError(name_loc, f"node {name}: {format_loc(tuple(first['loc']))}: {first['msg']}") from None
    return nodes


def _slurm_nodes(f: InventoryFile, base: Path, ask: AskSlurm | None) -> tuple[list[Node], str]:
    """The nodes of the Slurm allocation named by ``slurm:`` (with ``defaults:`` applied), as ``ask`` reports it."""
    if ask is None:
        raise _LocatedError(("slurm",), "this reader of the inventory does not ask Slurm for the allocation's nodes",
                            "load a `slurm:` inventory with load_inventory(path, slurm=hetctl.remote.slurmalloc.allocation)")
    try:
        held = ask(f.slurm)  # type: ignore[arg-type]
    except AllocationError as e:
        raise _LocatedError(("slurm", *e.key), e.message, e.hint) from None
    except HetctlError as e:
        raise _LocatedError(("slurm",), e.message, e.hint) from None
    defaults = f.defaults.model_dump(exclude_none=True)
    defaults.pop("transport", None)
    workdir = _node_workdir(defaults.pop("workdir", DEFAULT_WORKDIR), "slurm", base, ("defaults", "workdir"))
    for key in ("user", "port", "identity_file", "proxy_jump"):  # ssh coordinates do not apply to srun
        defaults.pop(key, None)
    nodes = []
    for an in held.nodes:
        topo = {"switch": an.switch} if an.switch is not None else {}  # the planner's `switch` label
        labels = {**topo, **defaults.get("labels", {}), "slurm_gres": an.gres, "slurm_features": ",".join(an.features),
                  "slurm_cpus": str(an.cpus), "slurm_memory_mb": str(an.memory_mb)}
        fields = {**defaults, "labels": labels, "env": dict(defaults.get("env", {}))}
        het = {"slurm_het_group": an.het_group, "slurm_het_component": an.het_component} \
            if an.het_group is not None else {}
        nodes.append(Node(name=an.name, host=an.name, hostname=an.addr, transport="slurm", workdir=workdir,
                          slurm_job=held.job, **het, **fields))
    return nodes, held.job


def _resolve(f: InventoryFile, base: Path, source: Path, ask: AskSlurm | None) -> Inventory:
    ssh = f.ssh.model_copy()
    if ssh.config is None or ssh.config.lower() == "none":
        ssh.config = None
    elif os.path.expanduser(ssh.config) == os.path.expanduser(DEFAULT_SSH_CONFIG):
        ssh.config = DEFAULT_SSH_CONFIG  # ssh finds it (and the system file) itself, if they exist
    else:
        path = _local_path(ssh.config, base)
        if not os.path.exists(path):
            raise _LocatedError(("ssh", "config"), f"ssh config {path} does not exist", "fix the path or set it to null")
        ssh.config = path
    if ssh.known_hosts is not None:
        ssh.known_hosts = _local_path(ssh.known_hosts, base)
    slurm_nodes, slurm_job = _slurm_nodes(f, base, ask) if f.slurm is not None else ([], None)
    nodes = slurm_nodes + _resolve_nodes(f, base, slurm_job)
    seen: set[str] = set()
    for n in nodes:
        if n.name in seen:
            raise _LocatedError(("nodes",), f"duplicate node {n.name!r}: the Slurm allocation already has it",
                                "list under nodes: only machines outside the allocation")
        seen.add(n.name)
    ckpt = f.checkpoint_dir
    if ckpt is not None and not (ckpt.startswith("/") or ckpt.startswith("~")):
        if any(n.transport != "local" for n in nodes):
            raise _LocatedError(
                ("checkpoint_dir",),
                f"{ckpt!r} is relative, but every node must see the same directory",
                "use an absolute path on shared storage",
            )
        ckpt = _local_path(ckpt, base)
    elif ckpt is not None and all(n.transport == "local" for n in nodes):
        ckpt = _local_path(ckpt, base)
    return Inventory(source=source, defaults=f.defaults, ssh=ssh, checkpoint_dir=ckpt, nodes=nodes, slurm=f.slurm,
                     public_env=f.public_env)


def load_inventory(path: str | Path, slurm: AskSlurm | None = None) -> Inventory:
    """Read, validate and resolve an inventory file.

    Args:
        slurm: how a ``slurm:`` block's nodes are found (:func:`hetctl.remote.slurmalloc.allocation`);
            without it such an inventory is refused.

    Raises:
        ConfigError: one line naming ``file:line: key.path`` and the problem, for
            unknown keys, bad types, bad ranges, duplicate nodes or missing files.
    """
    p = Path(path)
    data, root = read_yaml(p, "inventory")
    if data is None:
        raise located_error(p, None, None, "inventory is empty", "list at least one node under nodes:")
    from hetctl.files.kinds import check_kind

    check_kind(p, data, "inventory")
    try:
        raw = InventoryFile.model_validate(data)
    except ValidationError as e:
        raise validation_error(p, e, root, InventoryFile) from None
    try:
        return _resolve(raw, p.resolve().parent, p, slurm)
    except _LocatedError as e:
        raise located_error(p, _line_of(root, e.loc), format_loc(e.loc), e.msg, e.hint) from None


def master_address(node: Node, dialled: str | None = None) -> str:
    """Rank 0's node as the other nodes reach it (``MASTER_ADDR``): its dialled address (127.0.0.1 for a
    local node).

    ``dialled`` is the address ssh actually dials (``HostName`` from ssh_config, as the
    transport's ``ssh -G`` reports it); without it the inventory's host is used.
    """
    host = dialled or node.hostname or node.host
    if node.transport == "local" and host in ("", "localhost"):
        return "127.0.0.1"
    return host

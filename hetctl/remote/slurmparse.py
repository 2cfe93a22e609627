"""What Slurm's query tools print, parsed: ``scontrol show node|job|topology`` records, node states, Gres.

Pure: text in, values out (tests feed them captured output of a real slurmctld).
:mod:`hetctl.remote.slurmq` runs the commands; the values here are what it and the
rest of hetctl hold of Slurm's answers (:class:`SlurmNode`, :class:`SlurmJob`, a
node's place in a heterogeneous job, :class:`HetPlace`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_KEY = re.compile(r"^([A-Za-z][A-Za-z0-9_:/.]*)=(.*)$")
# Node states that mean the node is gone for this job (the base state, before flags like +DRAIN).
LOST_STATES = ("DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "POWERED_DOWN", "FUTURE")


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol show …`` record: ``Key=value`` tokens; a token without ``=`` continues the last value."""
    out: dict[str, str] = {}
    last = None
    for tok in line.split():
        m = _KEY.match(tok)
        if m:
            last = m.group(1)
            out[last] = m.group(2)
        elif last is not None:
            out[last] += " " + tok
    return out


def _record_lines(text: str) -> list[str]:
    """Each record of ``scontrol show …`` output as one line.

    With ``-o`` every line is a record. Without it a record starts at an unindented
    line (``NodeName=…``, ``JobId=…``) and goes on over indented ones; blank lines
    separate records but may also fall inside one (Slurm 24.05 puts one before a
    node's ``Reason=``), so only indentation decides.
    """
    records: list[str] = []
    for ln in text.splitlines():
        if not ln.strip():
            continue
        if ln[:1].isspace() and records:
            records[-1] += " " + ln.strip()
        else:
            records.append(ln.strip())
    return records


def parse_records(text: str) -> list[dict[str, str]]:
    """Every record of ``scontrol show …`` output, one-line (``-o``) or multi-line."""
    return [parse_record(ln) for ln in _record_lines(text) if "=" in ln]


def given(value: str | None) -> str:
    """A value as scontrol prints it, with its words for none (``(null)``, ``N/A``, ``none``) as ``""``."""
    return "" if value in (None, "(null)", "N/A", "none") else value


def _int(value: str | None) -> int:
    """A count as scontrol prints it (``4``, ``2-2`` for a range: its low end); 0 when absent or not a number."""
    m = re.match(r"\d+", value or "")
    return int(m.group()) if m else 0


@dataclass(frozen=True)
class HetPlace:
    """Where a node sits in a heterogeneous job (``salloc … : …``, ``#SBATCH hetjob``).

    Steps go to ``srun --jobid=<leader> --het-group=<group>``: srun takes only the
    leader's id (a component's own id is refused: "Job not heterogeneous job
    leader"), and without ``--het-group`` it starts nothing outside the allocation
    ("No directives to start application on any available hetjob components") and
    only on component 0 inside it. squeue lists a step of component K under the
    component's own job id (``<component>.<step>``), never under the leader's.
    """

    leader: str  # HetJobId, the id srun --jobid takes
    group: int  # HetJobOffset, srun's --het-group
    component: str  # the component's own JobId (squeue -s -j, scancel <component>.<step>)

    @property
    def label(self) -> str:
        """Slurm's own name of the component: ``<leader>+<offset>``."""
        return f"{self.leader}+{self.group}"


@dataclass(frozen=True)
class SlurmNode:
    """A node as ``scontrol show node`` describes it."""

    name: str
    addr: str
    cpus: int = 0
    memory_mb: int = 0
    gres: str = ""  # "gpu:2" or "gpu:a100:8,nic:1"
    features: tuple[str, ...] = ()
    state: str = ""
    partitions: tuple[str, ...] = ()
    reason: str = ""  # why slurmctld set the state (DOWN/DRAIN), e.g. "Not responding"
    het: HetPlace | None = None  # set by job_nodes for a node of a heterogeneous job: which component holds it

    @property
    def lost(self) -> bool:
        """True when the state says the node is unusable (DOWN, DRAIN, FAIL, not responding …)."""
        parts = re.split(r"[+*]", self.state.upper())
        return any(p in LOST_STATES for p in parts if p) or self.state.endswith("*")

    @property
    def down(self) -> bool:
        """Lost in a state Slurm acts on (DOWN, DRAIN, FAIL …), not merely NOT_RESPONDING (``*``), which
        becomes DOWN after SlurmdTimeout."""
        return any(p in LOST_STATES and p != "NOT_RESPONDING" for p in re.split(r"[+*]", self.state.upper()))


def parse_nodes(text: str) -> list[SlurmNode]:
    """``scontrol show node -o`` → nodes."""
    nodes = []
    for rec in parse_records(text):
        if "NodeName" not in rec:
            continue
        features = given(rec.get("AvailableFeatures", rec.get("Features")))  # Features= before Slurm 17.11
        nodes.append(SlurmNode(
            name=rec["NodeName"], addr=given(rec.get("NodeAddr")) or rec["NodeName"],
            cpus=_int(rec.get("CPUTot", rec.get("CPUs"))), memory_mb=_int(rec.get("RealMemory")),
            gres=given(rec.get("Gres")), features=tuple(f for f in features.split(",") if f),
            state=rec.get("State", ""), partitions=tuple(p for p in given(rec.get("Partitions")).split(",") if p),
            reason=given(rec.get("Reason")),
        ))
    return nodes


@dataclass(frozen=True)
class SlurmJob:
    """A job as ``scontrol show job`` describes it."""

    job_id: str
    state: str
    node_list: str
    num_nodes: int
    partition: str = ""
    features: str = ""
    het_job_id: str = ""  # HetJobId: the leader of the heterogeneous job this is a component of ("" for a plain job)
    het_offset: int | None = None  # HetJobOffset: the component's index (srun --het-group)
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def het(self) -> HetPlace | None:
        """Where this component sits in its heterogeneous job; None for a plain job."""
        if not self.het_job_id or self.het_offset is None:
            return None
        return HetPlace(self.het_job_id, self.het_offset, self.job_id)


def parse_jobs(text: str) -> list[SlurmJob]:
    """Every record of ``scontrol show job`` (``-o`` or not): one for a plain job, one per component of a
    heterogeneous job asked for by its leader's id (``HetJobId``, ``HetJobOffset``)."""
    out = []
    for rec in parse_records(text):
        if "JobId" not in rec:
            continue
        offset = rec.get("HetJobOffset", "")
        out.append(SlurmJob(job_id=rec["JobId"], state=rec.get("JobState", ""), node_list=given(rec.get("NodeList")),
                            num_nodes=_int(rec.get("NumNodes")), partition=rec.get("Partition", ""),
                            features=given(rec.get("Features")), het_job_id=given(rec.get("HetJobId")),
                            het_offset=int(offset) if offset.isdigit() else None, extra=rec))
    return out


def parse_job(text: str) -> SlurmJob | None:
    """The first record of ``scontrol show job``."""
    jobs = parse_jobs(text)
    return jobs[0] if jobs else None


def parse_topology(text: str) -> dict[str, str]:
    """``scontrol show topology`` → node name → the switch (topology/tree) or block (topology/block) it hangs off.

    Under a tree every switch names all the nodes below it (``SwitchName=spine Level=1 … Nodes=n[1-4]``),
    so a node's switch is the lowest-level one that names it, its leaf. A node list that is not a
    valid hostlist, or names more than :data:`hetctl.files.hostrange.MAX_NODES`, is skipped: the
    topology only labels nodes, it never adds any.
    """
    import hostlist

    from hetctl.files.hostrange import MAX_NODES, count_hostlist

    best: dict[str, tuple[int, str]] = {}
    for rec in parse_records(text):
        name = rec.get("SwitchName") or rec.get("BlockName")
        nodes = rec.get("Nodes", "")
        if not name or not nodes or count_hostlist(nodes) > MAX_NODES:
            continue
        level = _int(rec.get("Level"))
        try:
            members = hostlist.expand_hostlist(nodes)
        except hostlist.BadHostlist:
            continue
        for node in members:
            if node not in best or level < best[node][0]:
                best[node] = (level, name)
    return {node: name for node, (_, name) in best.items()}


def lost_words(node: SlurmNode) -> str:
    """What Slurm says of a node, for an event's reason: ``slurm: node c2 is DOWN (Not responding)``."""
    parts = [p for p in re.split(r"[+*]", node.state.upper()) if p]
    flags = [p for p in parts if p in LOST_STATES]
    if node.state.endswith("*") and "NOT_RESPONDING" not in flags:
        flags.append("NOT_RESPONDING")
    what = "+".join(flags or parts) or "in no state"
    return f"slurm: node {node.name} is {what}" + (f" ({node.reason})" if node.reason else "")


def _gres_items(gres: str) -> dict[str, int]:
    """``gpu:a100:8(S:0-1),nic:1`` → ``{"gpu": 8, "nic": 1}`` (type names ignored, counts added)."""
    out: dict[str, int] = {}
    for item in filter(None, (g.strip() for g in re.sub(r"\([^)]*\)", "", gres).split(","))):
        parts = item.split(":")
        count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        out[parts[0]] = out.get(parts[0], 0) + count
    return out


def gres_fits(have: str, want: str) -> bool:
    """True when a node's Gres ``have`` holds at least the Gres ``want`` (per name)."""
    h = _gres_items(have)
    return all(h.get(k, 0) >= n for k, n in _gres_items(want).items())

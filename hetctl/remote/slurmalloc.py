"""hetctl's own Slurm allocation, for a ``slurm:`` inventory used outside one.

Inside an allocation (``SLURM_JOB_ID`` set, or ``slurm.job``) hetctl uses that job
and never asks for another. Outside one, an inventory whose ``slurm:`` names what
it wants (``partition``, ``features``, ``gres``, ``nodes``) lets ``hetctl launch``
and ``hetctl resume`` ask Slurm themselves::

    salloc --no-shell --no-kill --job-name=hetctl -p P -N N [-w NODES] -C a&b --gres=G

(an argument list, never a shell line). ``--no-shell``: salloc returns once the
job is granted and the job stays until cancelled, so hetctl's srun steps run in
it; ``--no-kill``: a node that fails is dropped from the job instead of ending
it, so the run can be re-planned on the survivors. ``launch`` names the plan's
nodes (``-w``) so that the plan fits the allocation it gets; ``resume`` asks for
as many nodes as the last plan used and re-plans on what it gets.

The job id is recorded in ``run.yaml`` (``inputs.slurm_allocation``); the job is
cancelled (``scancel``) when the run ends or is stopped. A controller killed
outside its control leaves it running: ``hetctl resume`` uses it again while it
runs, and asks for a new one once it is gone.

Which job a ``slurm:`` block means, and its nodes checked against the block, is
:func:`allocation_nodes`; :func:`allocation` is what a command passes to
:func:`hetctl.files.inventory.load_inventory` (``slurm=``) to expand the block into nodes.
Loading the inventory does the asking (:func:`granted`) only inside :func:`allowed`, so
``plan``, ``status`` and ``--dry-run`` never allocate anything.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import re
import signal
import subprocess
import threading
import time
from typing import Callable, Iterator, Sequence

from hetctl.errors import HetctlError
from hetctl.files.allocation import AllocatedNode, Allocation, AllocationError
from hetctl.remote import slurmq
from hetctl.remote.slurmparse import SlurmNode, given, gres_fits

Progress = Callable[[str], None]
WAIT_NOTE_EVERY_S = 10.0  # how often "still waiting" is said while the job is pending
_JOB = re.compile(r"(?:Pending job allocation|Granted job allocation|job) (\d+)")
_ACTIVE: contextvars.ContextVar["Allocator | None"] = contextvars.ContextVar("hetctl_slurm_allocator", default=None)


def wants_allocation(s) -> bool:
    """True when a ``slurm:`` block says what to ask for (so hetctl may ask itself)."""
    return bool(s is not None and (s.partition or s.features or s.gres or s.nodes))


def salloc_argv(s, nodelist: Sequence[str] = (), count: int = 0, name: str = "hetctl") -> list[str]:
    """The salloc command line for the ``slurm:`` block ``s`` (with ``nodelist`` as ``-w``, ``count`` nodes at least)."""
    n = max(s.nodes or 0, len(nodelist), count, 1)
    argv = ["salloc", "--no-shell", "--no-kill", f"--job-name={name}"]
    if s.partition:
        argv += ["-p", s.partition]
    argv += ["-N", str(n)]
    if nodelist:
        argv += ["-w", ",".join(nodelist)]
    if s.features:
        argv += ["-C", "&".join(s.features)]
    if s.gres:
        argv += [f"--gres={s.gres}"]
    return argv


def _lines(stream, out: queue.SimpleQueue) -> None:
    for line in iter(stream.readline, ""):
        out.put(line.rstrip("\n"))
    out.put(None)


def allocate(s, nodelist: Sequence[str] = (), count: int = 0, progress: Progress = lambda line: None,
             clock: Callable[[], float] = time.monotonic) -> str:
    """Ask Slurm for an allocation and wait for it (saying so); the job id.

    The partition is checked first (``sinfo``: no such partition, no node with the
    features or Gres, too few nodes), so a request that can never be met is a
    one-line error, not a job pending forever. Interrupted (Ctrl-C), the pending
    job is cancelled.

    Raises:
        HetctlError: salloc/sinfo missing, the request refused, or salloc failed.
    """
    check_partition(s)
    salloc = slurmq.client("salloc")
    argv = salloc_argv(s, nodelist, count)
    progress("slurm: asking for an allocation: " + " ".join(argv))
    from hetctl.node.rankproc import _death_signal_hook

    try:
        # SIGTERM to salloc when hetctl dies, even by SIGKILL: salloc then revokes its pending request.
        proc = subprocess.Popen([salloc, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                preexec_fn=_death_signal_hook(int(signal.SIGTERM)))
    except OSError as e:
        raise HetctlError(f"cannot run salloc: {e.strerror}") from None
    lines: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True, name="salloc").start()
    job, said, errors = None, [], []
    t0 = note = clock()
    restore = _sigterm_interrupts()
    try:
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                if clock() - note >= WAIT_NOTE_EVERY_S:
                    note = clock()
                    progress(f"slurm: still waiting for job {job or '?'} ({clock() - t0:.0f} s); Ctrl-C cancels it")
                continue
            if line is None:
                break
            said.append(line)
            m = _JOB.search(line)
            job = job or (m.group(1) if m else None)
            if line.startswith("salloc: error:"):
                errors.append(line.removeprefix("salloc: error:").strip())
            elif line.strip():
                progress(line.replace("salloc: ", "slurm: ", 1))
        code = proc.wait()
    except BaseException:
        proc.terminate()  # salloc revokes its pending request on SIGTERM
        if job:
            release(job)
        raise
    finally:
        restore()
    if code != 0 or job is None or not any("Granted job allocation" in ln for ln in said):
        why = errors[-1] if errors else (said[-1] if said else f"exit code {code}")
        if job:
            release(job)
        raise HetctlError(f"salloc could not allocate ({' '.join(argv[1:])}): {why}",
                          "check the request against `sinfo -s` or relax slurm: in the inventory")
    progress(f"slurm: granted job {job} after {clock() - t0:.1f} s")
    return job


def _sigterm_interrupts() -> Callable[[], None]:
    """While salloc waits, SIGTERM to hetctl interrupts the wait like Ctrl-C; returns the undo.

    Without it a ``kill`` of a pending ``hetctl launch`` ends hetctl before anything
    cancels the request, and the job is granted later with nobody to use or release it.
    Only in the main thread (elsewhere signal handlers cannot be set; the death signal
    still covers it).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, old)


def alive(job: str) -> bool:
    """True while ``job`` is RUNNING."""
    try:
        slurmq.show_job(job)
        return True
    except HetctlError:
        return False


def release(job: str) -> None:
    """Cancel ``job`` (``scancel JOB``); best effort, bounded."""
    try:
        subprocess.run([slurmq.client("scancel"), job], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (HetctlError, OSError, subprocess.TimeoutExpired):
        pass


class Allocator:
    """The allocation of one command: asked once (or ``reuse``'s job while it runs), released by :meth:`release`."""

    def __init__(self, nodelist: Sequence[str] = (), count: int = 0, reuse: str | None = None,
                 progress: Progress = lambda line: None) -> None:
        self.nodelist, self.count, self.reuse, self.progress = list(nodelist), count, reuse, progress
        self.job: str | None = None

    def __call__(self, s) -> str:
        if self.job is None:
            if self.reuse and alive(self.reuse):
                self.progress(f"slurm: using job {self.reuse} again (hetctl asked for it before; it still runs)")
                self.job = self.reuse
            else:
                if self.reuse:
                    self.progress(f"slurm: job {self.reuse} is gone; asking for a new allocation")
                self.job = allocate(s, self.nodelist, self.count, self.progress)
        return self.job

    def release(self) -> None:
        """Cancel the job hetctl asked for (nothing when it asked for none)."""
        if self.job is not None:
            release(self.job)
            self.progress(f"slurm: released job {self.job}")
            self.job = None


@contextlib.contextmanager
def allowed(allocator: Allocator) -> Iterator[Allocator]:
    """Within this block, loading a ``slurm:`` inventory outside an allocation asks ``allocator`` for one."""
    token = _ACTIVE.set(allocator)
    try:
        yield allocator
    finally:
        _ACTIVE.reset(token)


def granted(s) -> str | None:
    """The job hetctl asked for itself for ``s``; None when no command allows it here or ``s`` asks for nothing."""
    allocator = _ACTIVE.get()
    if allocator is None or not wants_allocation(s):
        return None
    return allocator(s)


def allocation_nodes(s) -> tuple[str, list[SlurmNode]]:
    """The job the ``slurm:`` block names (``slurm.job``, else ``SLURM_JOB_ID``, else the one hetctl asks for
    itself where the command allows it: :func:`granted`) and its nodes, checked against it.

    Raises:
        AllocationError: no allocation, a node without an asked feature, fewer nodes than asked.
        HetctlError: Slurm cannot be asked (client missing, job unknown or not running).
    """
    job = s.job or slurmq.current_job()
    if not job:
        job = granted(s)  # hetctl's own allocation, where the command may ask for one (launch, resume)
    if not job:
        if s.partition or s.features or s.gres:
            check_partition(s)  # say now when no allocation could ever match
        want = " ".join(filter(None, [f"-p {s.partition}" if s.partition else "", f"-N {s.nodes}" if s.nodes else "",
                                      f"-C {'&'.join(s.features)}" if s.features else "",
                                      f"--gres={s.gres}" if s.gres else ""]))
        raise AllocationError((), "no Slurm allocation: SLURM_JOB_ID is not set and slurm.job is not given",
                              f"run hetctl inside one (salloc {want + ' ' if want else ''}hetctl …) or set slurm.job"
                              + ("; `hetctl launch` and `hetctl resume` ask for one themselves" if want else ""))
    found = slurmq.job_nodes(job)
    job = next((n.het.leader for n in found if n.het is not None), job)  # the id srun takes: a het job's leader
    lacking = [(n.name, ft) for n in found for ft in s.features if ft not in n.features]
    if lacking:
        raise AllocationError(("features",), f"node {lacking[0][0]} of job {job} lacks feature {lacking[0][1]!r}",
                              "ask for the allocation with -C (salloc -C " + "&".join(s.features) + ") or drop the feature")
    if s.nodes is not None and len(found) < s.nodes:
        raise AllocationError(("nodes",), f"job {job} has {len(found)} node(s), the inventory asks for {s.nodes}",
                              f"ask for a larger allocation (salloc -N {s.nodes}) or lower slurm.nodes")
    return job, found


def check_partition(s) -> None:
    """Raise an AllocationError when the partition cannot give what ``slurm:`` asks (``sinfo``, no allocation made)."""
    argv = ["sinfo", "-h", "-N", "-o", "%N|%f|%G|%T"] + (["-p", s.partition] if s.partition else [])
    r = slurmq.query(argv, "reading the Slurm partitions")
    if r.returncode != 0:
        raise HetctlError(f"sinfo failed: {slurmq.last_line(r)}", "check that slurmctld is up: scontrol ping")
    rows = [ln.split("|") for ln in r.stdout.splitlines() if ln.count("|") == 3]
    where = f"partition {s.partition}" if s.partition else "the cluster"
    if not rows:
        raise AllocationError(("partition",), f"Slurm has no partition {s.partition!r} (or it holds no node)",
                              "list the partitions with `sinfo -s`")
    fit = sorted({name for name, feats, gres, _ in rows
                  if set(s.features) <= set(given(feats).split(",")) and (not s.gres or gres_fits(given(gres), s.gres))})
    asked = " and ".join(filter(None, [f"features {','.join(s.features)}" if s.features else "",
                                        f"gres {s.gres}" if s.gres else ""]))
    if not fit:
        feats = sorted({f for _, fs, _, _ in rows for f in given(fs).split(",") if f})
        raise AllocationError(("features" if s.features else "gres",), f"{where} has no node with {asked}",
                              f"its nodes offer features {','.join(feats) or 'none'}; pick another partition or relax slurm:")
    if s.nodes is not None and len(fit) < s.nodes:
        with_ = f" with {asked}" if asked else ""
        raise AllocationError(("nodes",), f"{where} has {len(fit)} node(s){with_}, the inventory asks for {s.nodes}",
                              "lower slurm.nodes or pick another partition")


def allocation(s) -> Allocation:
    """What the ``slurm:`` block ``s`` holds, for :func:`hetctl.files.inventory.load_inventory` (``slurm=``): the
    job (:func:`allocation_nodes`) and its nodes, each with the switch Slurm's topology puts it under.

    Raises:
        AllocationError, HetctlError: as :func:`allocation_nodes`.
    """
    job, found = allocation_nodes(s)
    switches = slurmq.topology_switches()  # topology.conf's leaf switches: the planner's `switch` label
    return Allocation(job, tuple(
        AllocatedNode(name=n.name, addr=n.addr, cpus=n.cpus, memory_mb=n.memory_mb, gres=n.gres, features=n.features,
                      het_group=n.het.group if n.het else None, het_component=n.het.component if n.het else None,
                      switch=switches.get(n.name))
        for n in found))

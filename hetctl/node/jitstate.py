"""Just-in-time checkpoints from the survivors of a failure: layout, choice, promotion (stdlib only).

When a rank fails and its stage has a data-parallel peer, each surviving rank of
the reference trainer writes its stage's weights and AdamW state at the last
step it can vouch for (:mod:`hetctl.train.jit`), in the layer-granular format of
a normal checkpoint, each rank in a folder of its own::

    <checkpoint_dir>/<run-id>/jit/<attempt>/rank-<r>/step-<N>/
        layer-00004.pt … head.pt state.json      (the rank's units)
        manifest.json                            (written last, atomically)

A rank folder's step exists only with a manifest whose files hash as listed, as
for a normal step (:func:`hetctl.node.manifest.validate`), so a dump cut short
(the agent's SIGKILL after ``--grace``) or damaged afterwards is never used.
:func:`choose` (pure) takes the newest step of one attempt at which the valid
dumps of every rank together hold every file of a complete checkpoint, each
file from the lowest rank that has it (replicas hold the same bytes: their
gradients were summed before the step). :func:`promote` then makes that step
an ordinary ``step-<N>`` checkpoint (hard links to the verified files, the
manifest last), so every reader, ``HETCTL_RESUME_STEP`` and ``hetctl resume``
included, loads it the one way it loads any checkpoint.

Dumps of one attempt are never mixed with another's: two attempts may hold the
same step computed over a different grouping of replicas (a re-plan that changed
the data-parallel width), and mixing their layers would be no step of either.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from hetctl.node import manifest

JIT_DIR = "jit"
KIND = "jit"  # the per-rank manifest's meta["kind"]
_ATTEMPT_DIR = re.compile(r"^(\d+)$")
_RANK_DIR = re.compile(r"^rank-(\d+)$")


def rank_dir(ckpt_dir: str | Path, attempt: int, rank: int) -> Path:
    """The folder of one rank's dumps in one attempt; its ``step-<N>`` folders are laid out as a checkpoint dir's."""
    return Path(ckpt_dir) / JIT_DIR / str(int(attempt)) / f"rank-{int(rank)}"


@dataclass(frozen=True)
class Dump:
    """One rank's dump of one step, as found on disk.

    Attributes:
        attempt, rank, step: where it is (``jit/<attempt>/rank-<rank>/step-<step>``).
        path: the step folder.
        files: the manifest's entries ``{name: {"size", "sha256"}}`` (empty when unreadable).
        completed: the last step the rank's training had completed when it dumped.
        problems: what is wrong with it (:func:`hetctl.node.manifest.validate`); empty when usable.
    """

    attempt: int
    rank: int
    step: int
    path: Path
    files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    completed: int | None = None
    problems: tuple[str, ...] = ()

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class JitChoice:
    """A complete step assembled from the survivors' dumps of one attempt.

    Attributes:
        attempt, step: the dumps' attempt and step.
        sources: per file of the checkpoint, the dump it is taken from.
        skipped: newer steps (or invalid dumps) passed over, one line each.
    """

    attempt: int
    step: int
    sources: Mapping[str, Dump]
    skipped: tuple[str, ...] = ()

    @property
    def ranks(self) -> list[int]:
        """The ranks whose dumps the step is made of."""
        return sorted({d.rank for d in self.sources.values()})


def attempts(ckpt_dir: str | Path) -> list[int]:
    """Attempts that left dumps, newest first."""
    d = Path(ckpt_dir) / JIT_DIR
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)) for p in d.iterdir() if (m := _ATTEMPT_DIR.match(p.name)) and p.is_dir()),
                  reverse=True)


def scan(ckpt_dir: str | Path, attempt: int, model_digest: str | None = None) -> list[Dump]:
    """Every rank's dumps of ``attempt``, each validated (sizes and sha256 against its manifest)."""
    base = Path(ckpt_dir) / JIT_DIR / str(int(attempt))
    if not base.is_dir() or base.is_symlink():
        return []
    found: list[Dump] = []
    for rdir in sorted(base.iterdir()):
        m = _RANK_DIR.match(rdir.name)
        if not m or not rdir.is_dir() or rdir.is_symlink():
            continue
        rank = int(m.group(1))
        for step, path in manifest.steps(rdir):
            problems = manifest.validate(path, model_digest)
            files: Mapping[str, Mapping[str, Any]] = {}
            completed = None
            if not problems:
                man = manifest.read_manifest(path)
                meta = man.get("meta") or {}
                if meta.get("kind") != KIND or meta.get("rank") != rank:
                    problems = [f"manifest meta is not rank {rank}'s just-in-time dump"]
                else:
                    files = man["files"]
                    completed = meta.get("completed") if isinstance(meta.get("completed"), int) else None
            found.append(Dump(attempt=int(attempt), rank=rank, step=step, path=path, files=files,
                              completed=completed, problems=tuple(problems)))
    return found


def choose(dumps: Iterable[Dump], expected: Iterable[str]) -> tuple[JitChoice | None, list[str]]:
    """The newest step whose valid dumps hold every file of ``expected`` (pure).

    Args:
        dumps: one attempt's dumps (:func:`scan`).
        expected: the files of a complete checkpoint
            (:func:`hetctl.train.units.expected_files` of the model).

    Returns:
        ``(choice, notes)``: the choice, or None when no step is complete; the notes say,
        newest first, why each newer step or dump was passed over.
    """
    want = set(expected)
    notes: list[str] = []
    by_step: dict[int, list[Dump]] = {}
    for d in dumps:
        if not d.valid:
            notes.append(f"rank {d.rank} step {d.step}: {d.problems[0]}")
            continue
        by_step.setdefault(d.step, []).append(d)
    for step in sorted(by_step, reverse=True):
        sources: dict[str, Dump] = {}
        for d in sorted(by_step[step], key=lambda d: d.rank):
            for name in d.files:
                if name in want:
                    sources.setdefault(name, d)
        missing = sorted(want - set(sources))
        if not missing:
            return JitChoice(attempt=by_step[step][0].attempt, step=step, sources=sources, skipped=tuple(notes)), notes
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        ranks = ", ".join(str(d.rank) for d in sorted(by_step[step], key=lambda d: d.rank))
        notes.append(f"step {step}: the dumps of rank {ranks} lack {shown}")
    return None, notes


def last_completed(dumps: Iterable[Dump]) -> int | None:
    """The newest step any dumping rank had completed in training (None when no dump says)."""
    done = [d.completed for d in dumps if d.completed is not None]
    return max(done) if done else None


def _place(src: Path, dst: Path) -> None:
    """Put ``src``'s bytes at ``dst`` atomically: a hard link when the file system allows, else a synced copy."""
    tmp = dst.parent / f".{dst.name}.jit-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dst)


def promote(ckpt_dir: str | Path, choice: JitChoice, model_digest: str, meta: Mapping[str, Any] | None = None) -> Path:
    """Make ``choice`` the ordinary checkpoint ``step-<N>``: its files in place, then the manifest, last.

    A ``step-<N>`` that is already valid is left as it is. Files left there by a save
    that never finished are replaced; the manifest lists exactly the chosen files,
    with the sizes and hashes their own manifests vouched for (checked again by
    every rank that loads one).

    Returns:
        The step folder.
    """
    from hetctl.node.safepath import check_inside

    d = check_inside(ckpt_dir, manifest.step_dir(ckpt_dir, choice.step))  # not through a planted link
    if d.is_dir() and not manifest.validate(d, model_digest):
        return d
    d.mkdir(parents=True, exist_ok=True)
    (d / manifest.MANIFEST).unlink(missing_ok=True)
    files: dict[str, Mapping[str, Any]] = {}
    for name, dump in sorted(choice.sources.items()):
        src = dump.path / name
        if manifest.sha256_file(src) != dump.files[name].get("sha256"):  # changed since it was chosen
            raise OSError(f"{src}: changed after it was verified")
        _place(src, d / name)
        files[name] = dump.files[name]
    info = {"source": KIND, "attempt": choice.attempt, "ranks": choice.ranks, **dict(meta or {})}
    manifest.write_manifest(d, choice.step, model_digest, files=files, meta=info)
    return d


def discard(ckpt_dir: str | Path, up_to_attempt: int) -> None:
    """Remove the dumps of attempts up to ``up_to_attempt`` (promoted steps keep their own links)."""
    from hetctl.node.safepath import check_inside, remove_tree

    jit = Path(ckpt_dir) / JIT_DIR
    try:
        check_inside(ckpt_dir, jit)  # other users may write the store: a planted link is not followed
    except OSError:
        return
    for a in attempts(ckpt_dir):
        if a <= up_to_attempt:
            remove_tree(ckpt_dir, jit / str(a))
    try:
        jit.rmdir()  # only when empty
    except OSError:
        pass

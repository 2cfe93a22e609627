"""Rank logs in the run folder, ``runs/<id>/logs/<node>/rank-<r>.log``: what the agents forward, appended.

Every attempt appends behind a ``==> hetctl attempt N, rank r on node <==`` line
(``hetctl logs -f`` follows across restarts by it); lines the agent's rate limit
dropped are counted in the log with where the node keeps the full one. A log
folder that is a planted symbolic link is refused, never followed.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import IO, Mapping

from hetctl.files.eventlog import open_append
from hetctl.files.run import RunDir


# Log files kept open at once: the ranks that print most keep theirs, the others are reopened for a write.
# Without a bound an attempt held one descriptor per rank (8,192 at 1,024 nodes × 8, bench/scale.py),
# past the usual soft limit of 1,024 before any connection was counted.
MAX_OPEN = 64


class RankLogs:
    """The log files of one attempt's ranks, at most ``max_open`` of them open at a time.

    Args:
        run: the run folder.
        attempt: the attempt, for the header line.
        nodes: rank → node.
        node_paths: rank → where the node keeps the rank's full log (for the dropped-lines note).
        max_open: how many log files stay open (least recently written closed first).
    """

    def __init__(self, run: RunDir, attempt: int, nodes: Mapping[int, str], node_paths: Mapping[int, str],
                 max_open: int = MAX_OPEN) -> None:
        self.run, self.attempt, self.nodes, self.node_paths = run, attempt, dict(nodes), dict(node_paths)
        self.max_open = max(1, max_open)
        self._open: OrderedDict[int, IO[str]] = OrderedDict()
        self._headed: set[int] = set()  # ranks whose header this attempt wrote
        self._failed: set[int] = set()
        self._errors: list[tuple[str, str]] = []
        self._dirs: set[Path] = set()  # node folders made and checked this attempt (8 ranks share one)

    def file(self, rank: int) -> IO[str] | None:
        """The rank's log, opened (and headed, once per attempt) on use; None once writing it failed
        (see :meth:`errors`)."""
        if rank in self._failed:
            return None
        f = self._open.get(rank)
        if f is not None:
            self._open.move_to_end(rank)
            return f
        node = self.nodes[rank]
        path = self.run.log_path(node, rank)
        try:
            if path.parent not in self._dirs:
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.parent.is_symlink():
                    raise OSError(f"{path.parent}: a symbolic link in the run folder")
                self._dirs.add(path.parent)
            while len(self._open) >= self.max_open:
                _close(self._open.popitem(last=False)[1])
            f = self._open[rank] = open_append(path)  # closed when evicted or in close()
            if rank not in self._headed:
                f.write(f"==> hetctl attempt {self.attempt}, rank {rank} on {node} <==\n")
                f.flush()
                self._headed.add(rank)
        except OSError as e:
            self._fail(rank, path, e)
            return None
        return f

    def write(self, rank: int, lines: list[str], dropped: int) -> None:
        """Append the rank's lines; a failed write (a full disk under the run folder) is recorded, not raised:
        the run's own storage failing is no fault of the rank or its node."""
        f = self.file(rank)
        if f is None:
            return
        try:
            for line in lines:
                f.write(line + "\n")
            if dropped:
                where = self.node_paths.get(rank, "the node's workdir")
                f.write(f"[hetctl: {dropped} lines over the agent's rate limit not copied; full log on "
                        f"{self.nodes[rank]}: {where}]\n")
            f.flush()
        except OSError as e:
            self._fail(rank, self.run.log_path(self.nodes[rank], rank), e)

    def _fail(self, rank: int, path: Path, e: OSError) -> None:
        self._failed.add(rank)
        f = self._open.pop(rank, None)
        if f is not None:
            try:
                f.close()
            except OSError:
                pass
        self._errors.append((str(path), e.strerror or str(e)))

    def errors(self) -> list[tuple[str, str]]:
        """The (path, reason) of each log that could not be written since the last call; its rank's later lines are
        not written either (the node keeps the full log)."""
        out, self._errors = self._errors, []
        return out

    def close(self) -> None:
        for f in self._open.values():
            _close(f)
        self._open.clear()

    def tail(self, rank: int, n: int = 20) -> str:
        """The last ``n`` lines of the rank's log ("" when there is none)."""
        try:
            lines = Path(self.run.log_path(self.nodes[rank], rank)).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def _close(f: IO[str]) -> None:
    try:
        f.close()
    except OSError:  # the last buffered bytes on a full disk: already recorded or lost either way
        pass

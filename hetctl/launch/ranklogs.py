"""Rank logs in the run folder, ``runs/<id>/logs/<node>/rank-<r>.log``: what the agents forward, appended.

Every attempt appends behind a ``==> hetctl attempt N, rank r on node <==`` line
(``hetctl logs -f`` follows across restarts by it); lines the agent's rate limit
dropped are counted in the log with where the node keeps the full one. A log
folder that is a planted symbolic link is refused, never followed.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Mapping

from hetctl.files.events import open_append
from hetctl.files.run import RunDir


class RankLogs:
    """The open log files of one attempt's ranks.

    Args:
        run: the run folder.
        attempt: the attempt, for the header line.
        nodes: rank → node.
        node_paths: rank → where the node keeps the rank's full log (for the dropped-lines note).
    """

    def __init__(self, run: RunDir, attempt: int, nodes: Mapping[int, str], node_paths: Mapping[int, str]) -> None:
        self.run, self.attempt, self.nodes, self.node_paths = run, attempt, dict(nodes), dict(node_paths)
        self._open: dict[int, IO[str]] = {}

    def file(self, rank: int) -> IO[str]:
        """The rank's log, opened (and headed) on first use."""
        f = self._open.get(rank)
        if f is None:
            node = self.nodes[rank]
            path = self.run.log_path(node, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.parent.is_symlink():
                raise OSError(f"{path.parent}: a symbolic link in the run folder")
            f = self._open[rank] = open_append(path)  # closed in close()
            f.write(f"==> hetctl attempt {self.attempt}, rank {rank} on {node} <==\n")
            f.flush()
        return f

    def write(self, rank: int, lines: list[str], dropped: int) -> None:
        f = self.file(rank)
        for line in lines:
            f.write(line + "\n")
        if dropped:
            where = self.node_paths.get(rank, "the node's workdir")
            f.write(f"[hetctl: {dropped} lines over the agent's rate limit not copied; full log on "
                    f"{self.nodes[rank]}: {where}]\n")
        f.flush()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def tail(self, rank: int, n: int = 20) -> str:
        """The last ``n`` lines of the rank's log ("" when there is none)."""
        try:
            lines = Path(self.run.log_path(self.nodes[rank], rank)).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

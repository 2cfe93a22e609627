"""Shared fixtures: an isolated HOME for every test and real sshd hosts on loopback.

* ``_isolated_home`` (autouse): ``HOME`` points at an empty per-test folder and
  ``SSH_AUTH_SOCK`` and ``XDG_STATE_HOME`` are unset (the index of runs is per test), so the developer's ``~/.ssh/config``, keys, agent and
  known_hosts never take part in a test. ``TORCH_EXTENSIONS_DIR`` is one folder per
  session, so a torch C++ extension (DeepSpeed's shared-memory op) is built once.
* ``_private_runtime_dir`` (session, autouse): ``XDG_RUNTIME_DIR`` points at a short
  private folder removed after the session, so the ssh transport's control sockets
  and generated configs (one per distinct ``ssh:`` settings, many in a test run) do
  not pile up in the developer's ``/tmp/hetctl-<uid>``.
* ``_no_spares_unless_asked`` (session, autouse): ``HETCTL_STANDBY=off``, so a launch
  starts no warm spares unless the test passes ``--standby`` (the standby tests do).
* ``_ranks_from_a_fork_server`` (session, autouse): ``HETCTL_TEST_ZYGOTE=1``, so the rank runner
  (:mod:`tests.helpers.rankrunner`) forks its ranks from one process that imported torch
  (:mod:`tests.helpers.zygote`); launches through the agent still start them cold.
* ``sshd_cluster`` (session): three running hosts shared by tests that only read
  from them. Do not kill, pause or install tools on it.
* ``make_sshd_cluster`` (function): a factory for private clusters a test may
  break (kill a host, change keys, install replay tools); each is stopped after the
  test, which then fails if any process it started is still alive.
* ``sshd_inventory``: an inventory file for the shared cluster, in ``tmp_path``.
* ``slurm_cluster`` (session) and ``make_slurm_cluster`` (function): a real Slurm
  mini-cluster (munged, slurmctld, one slurmd per node; :mod:`tests.helpers.slurm`), shared
  read-only or private to a test that breaks it; skipped without root or the Slurm
  binaries. The private ones must leave no process behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.helpers.slurm import SlurmCluster, skip_reason as slurm_skip_reason
from tests.helpers.sshd import SshdCluster

FIXTURES = Path(__file__).parent / "fixtures"
SMI_SAMPLES = FIXTURES / "smi-samples"

# The one place that knows what real sshd hosts need, and what makes a test end-to-end.
HAVE_SSHD = os.geteuid() == 0 and Path("/usr/sbin/sshd").exists()
NO_SSHD = "needs root and /usr/sbin/sshd for real sshd hosts"
# "cluster": the module-scoped sshd cluster of the launch and recovery suites.
SSHD_FIXTURES = {"sshd_cluster", "make_sshd_cluster", "sshd_inventory", "cluster"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests on real sshd hosts are ``e2e`` and skipped (with the reason) where sshd cannot run.

    A test needs sshd when it is marked ``sshd`` or uses a fixture that starts sshd
    hosts; either way it joins the end-to-end lane, so ``-m "not e2e"`` never
    starts a server.
    """
    for item in items:
        uses = SSHD_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses or item.get_closest_marker("sshd"):
            item.add_marker(pytest.mark.e2e)
            if not HAVE_SSHD:
                item.add_marker(pytest.mark.skip(reason=NO_SSHD))
    # The order the test processes take modules in (pytest-xdist --dist loadscope hands out modules in
    # collection order): the modules with the most end-to-end tests first, the fast ones last, so that
    # a process that finishes early finds short modules left instead of idling while the other runs a
    # long one (the last long module left one process idle for 30 s of a 20-minute run).
    e2e: dict[str, int] = {}
    for item in items:
        e2e[item.path] = e2e.get(item.path, 0) + bool(item.get_closest_marker("e2e"))
    items.sort(key=lambda item: -e2e[item.path])  # stable: a module's own order is kept


@pytest.fixture(scope="session", autouse=True)
def _private_runtime_dir():
    runtime = tempfile.mkdtemp(prefix="hx-")  # short: control sockets must fit a unix socket path
    before = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = runtime
    try:
        yield runtime
    finally:
        if before is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = before
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _no_spares_unless_asked():
    """``HETCTL_STANDBY=off`` for every ``hetctl launch`` the tests start (issue 38): a warm spare per rank imports
    torch beside the training ranks, about a quarter of a launch test's time on two cores, and only a restart
    uses it. The tests of warm standby itself, and of its processes' cleanup, pass ``--standby auto``."""
    before = os.environ.get("HETCTL_STANDBY")
    os.environ["HETCTL_STANDBY"] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HETCTL_STANDBY", None)
        else:
            os.environ["HETCTL_STANDBY"] = before


@pytest.fixture(scope="session", autouse=True)
def _ranks_from_a_fork_server():
    """``HETCTL_TEST_ZYGOTE=1``: the rank runner forks its ranks from a process that imported torch once
    (``tests/helpers/zygote.py``) instead of ~1.9 CPU-s of import in each (issue 38). ``HETCTL_TEST_ZYGOTE=0`` in
    the caller's environment keeps every rank cold."""
    before = os.environ.get("HETCTL_TEST_ZYGOTE")
    os.environ["HETCTL_TEST_ZYGOTE"] = before if before is not None else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HETCTL_TEST_ZYGOTE", None)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path_factory.mktemp("home")
    (home / ".ssh").mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    # torch's C++ extensions (DeepSpeed builds its shared-memory op on the first init_distributed, ~35 s of
    # CPU) are built once per session, not once per test's HOME; torch locks the folder while building.
    base = tmp_path_factory.getbasetemp()
    session = base.parent if base.name.startswith("popen-gw") else base  # shared by the xdist workers
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(session / "torch-extensions"))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)  # the index of runs (files/runindex.py) lives under HOME
    return home


@pytest.fixture(scope="session")
def sshd_cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = SshdCluster(tmp_path_factory.mktemp("sshd-shared"), 3).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _private_clusters(tmp_path_factory: pytest.TempPathFactory, what: str, build: Callable[..., object]):
    """A factory of clusters a test may break; each is stopped after the test, which then fails if any
    process it started is still alive."""
    clusters: list = []

    def make(*args: object, **kwargs: object):
        cluster = build(tmp_path_factory.mktemp(what), *args, **kwargs)
        clusters.append(cluster)
        return cluster.start()

    yield make
    left = []
    for cluster in clusters:
        cluster.stop()
        left += cluster.leftovers()
    assert not left, f"processes left behind by the {what} fixture: {left}"


@pytest.fixture
def make_sshd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., SshdCluster]:
    yield from _private_clusters(tmp_path_factory, "sshd", lambda root, n=2, **kw: SshdCluster(root, n, **kw))


@pytest.fixture
def sshd_inventory(sshd_cluster: SshdCluster, tmp_path: Path) -> Path:
    return sshd_cluster.write_inventory(tmp_path / "inventory.yaml")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """Three nodes (n1 gpu:2/nvidia, n2 npu:2/ascend, n3 cpu); tests must not kill or reconfigure them."""
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-shared")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def make_slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., SlurmCluster]:
    reason = slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    yield from _private_clusters(tmp_path_factory, "slurm", SlurmCluster)


# --- The suite's own timing (issue: CI green every time, and fast) -------------------------------
# Every test's wall time (setup + call + teardown) by group, printed at the end of every run, so that
# growth shows at once in CI's log: the fast lane, the sshd tests, the Slurm tests, and the other
# end-to-end tests (torch ranks, local processes).
_GROUP_TIMES: dict[str, dict[str, float]] = {}


def _group(item: pytest.Item) -> str:
    names = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("e2e") is None:
        return "fast"
    if {"slurm_cluster", "make_slurm_cluster"} & names or "test_slurm" in item.nodeid:
        return "e2e:slurm"
    if SSHD_FIXTURES & names or item.get_closest_marker("sshd"):
        return "e2e:sshd"
    return "e2e:other"


# Per test process (xdist worker, or "main"): [first start, last stop, busy seconds], to show how long
# each worker idled at the end while another finished its last module.
_WORKERS: dict[str, list[float]] = {}
_CPU_AT_START: list[tuple[float, float]] = []


def _cpu_busy_seconds() -> float:
    """Busy CPU seconds of this machine since boot, all cores, from /proc/stat (Linux; 0 elsewhere)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def pytest_sessionstart(session: pytest.Session) -> None:
    _CPU_AT_START[:] = [(_cpu_busy_seconds(), time.time())]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    group = getattr(report, "hetctl_group", None)
    if group is not None:
        tests = _GROUP_TIMES.setdefault(group, {})
        tests[report.nodeid] = tests.get(report.nodeid, 0.0) + report.duration
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", None) or "main"
        row = _WORKERS.setdefault(worker, [report.start, report.stop, 0.0])
        row[0], row[1], row[2] = min(row[0], report.start), max(row[1], report.stop), row[2] + report.duration


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    outcome.get_result().hetctl_group = _group(item)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _GROUP_TIMES:
        return
    tr = terminalreporter
    tr.section("time per group (setup + call + teardown)")
    for group, tests in sorted(_GROUP_TIMES.items(), key=lambda kv: -sum(kv[1].values())):
        tr.write_line(f"{group:<10} {sum(tests.values()):8.1f} s  over {len(tests):4d} tests")
    if _CPU_AT_START and len(_WORKERS) > 1:
        start = min(r[0] for r in _WORKERS.values())
        end = max(r[1] for r in _WORKERS.values())
        for worker, (_first, last, busy) in sorted(_WORKERS.items()):
            tr.write_line(f"{worker:<10} {busy:8.1f} s  in tests, done {last - start:7.1f} s after the first test "
                          f"(idle {end - last:6.1f} s at the end)")
        busy0, t0 = _CPU_AT_START[0]
        cores = os.cpu_count() or 1
        used = (_cpu_busy_seconds() - busy0) / max(time.time() - t0, 1e-9)
        tr.write_line(f"machine    {used:8.2f} of {cores} cores busy on average over the run (all processes)")

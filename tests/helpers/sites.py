"""A probed site on real sshd hosts, and the real CLI run against it (shared by the launch and recovery tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.helpers.sshd import SshdCluster


def env_of(d: Path) -> dict:
    """The CLI's environment: a HOME of the site's own (no developer ssh config), no ssh-agent."""
    env = {**os.environ, "HOME": str(d / "home"), "COLUMNS": "200"}
    env.pop("SSH_AUTH_SOCK", None)
    return env


def hetctl(d: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``hetctl ARGS`` in the site folder ``d`` as a user would."""
    return subprocess.run([sys.executable, "-m", "hetctl", *args], cwd=d, env=env_of(d), capture_output=True,
                          text=True, timeout=timeout)


def probed_site(cluster: SshdCluster, d: Path, tflops: dict[str, float]) -> Path:
    """Write ``d/inventory.yaml`` (checkpoints on 'shared storage', per-node tflops) and probe it to ``cluster.yaml``."""
    (d / "home" / ".ssh").mkdir(parents=True)
    inv = cluster.inventory(
        defaults={"user": "root", "identity_file": str(cluster.client_key), "python": sys.executable,
                  "env": {"OMP_NUM_THREADS": "1"}},
        checkpoint_dir=str(d / "shared-ckpt"),
    )
    for n in inv["nodes"]:
        n["tflops"] = tflops[n["name"]]
    (d / "inventory.yaml").write_text(yaml.safe_dump(inv, sort_keys=False))
    r = hetctl(d, "probe", "-i", "inventory.yaml", "-o", "cluster.yaml")
    assert r.returncode == 0, r.stderr
    return d


def local_cli(d: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``hetctl ARGS`` in ``d`` for a local site (the developer's HOME is harmless there: no ssh)."""
    return subprocess.run([sys.executable, "-m", "hetctl", *args], cwd=d, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


_PROBED: list = []  # the demo nodes' probe, once per test process (see local_site)


def local_site(d: Path) -> Path:
    """The demo's three local nodes, probed, with the tiny model planned as PP=3 in ``d/plan``.

    The nodes are probed (each times a ``tiny`` layer: about 10 s of CPU) once per test
    process, the first time a test asks; later sites get a copy of that ``cluster.yaml``
    that names their own inventory. The tests that judge the probe itself run it (the demo's
    and the profile tests).
    """
    from hetctl.cli import demo
    from hetctl.files.yamlio import save_model

    inv = demo.write_inventory(d)
    if not _PROBED:
        _PROBED.append(demo.probe_nodes(inv)[1])
    cluster = _PROBED[0].model_copy(update={"inventory": str(inv.resolve())})
    save_model(d / "cluster.yaml", cluster, header="hetctl demo: probed")
    demo.plan_tiny(d, cluster)
    return d


def wait_while_running(proc: subprocess.Popen, fn, what: str, timeout: float):
    """Poll ``fn()`` until it is truthy and return it; fail when ``proc`` (a launch) ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        if proc.poll() is not None:
            raise AssertionError(f"launch ended before {what}: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {what} within {timeout} s")

"""``bench/hetero_cpu.py --cpus-per-node``: each node's own CPUs (nothing timed, no launch)."""

from __future__ import annotations

import pytest

from hetctl.files.inventory import load_inventory
from tests.helpers.benches import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("hetero_cpu")


def test_each_node_gets_disjoint_cores_when_there_are_enough(bench):
    sets, shared = bench.core_sets([8, 4, 2], list(range(16)))
    assert sets == {"node-a": list(range(8)), "node-b": [8, 9, 10, 11], "node-c": [12, 13]} and not shared


def test_the_sets_follow_the_cpus_this_process_may_use(bench):
    sets, shared = bench.core_sets([2, 1, 1], [1, 3, 5, 7, 9])
    assert sets == {"node-a": [1, 3], "node-b": [5], "node-c": [7]} and not shared


def test_too_few_cores_wrap_around_and_say_so(bench):
    sets, shared = bench.core_sets([2, 1, 1], [0, 1])
    assert sets == {"node-a": [0, 1], "node-b": [0], "node-c": [1]} and shared


def test_cpu_lists_are_written_as_taskset_ranges(bench):
    assert bench._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert bench._ranges([3]) == "3"


def test_the_inventory_gives_each_node_its_threads_and_cpus(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "cli", lambda d, *args, **kw: None)  # the probe is not what is checked here
    sets, _ = bench.core_sets([2, 1, 1], [0, 1, 2, 3])
    bench.write_site(tmp_path, {}, 6, cores=sets)
    inv = load_inventory(tmp_path / "inventory.yaml")
    assert {n.name: n.env["OMP_NUM_THREADS"] for n in inv.nodes} == {"node-a": "2", "node-b": "1", "node-c": "1"}
    assert "exec taskset -c 0-1 " in (tmp_path / "python-node-a").read_text()
    assert "cgroup.procs" not in (tmp_path / "python-node-c").read_text()

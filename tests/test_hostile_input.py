"""Hostile input to the file loaders and the numeric options: a valid load or one line, never a traceback.

Issue 17, item 9, and the misspelt-key report of issue 8. The three loaders
(inventory, cluster file, plan) are fuzzed with Hypothesis over arbitrary bytes,
YAML-looking text and mutations of valid files; every regression of the issue
then has its own test, through the real CLI where that costs little.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import hostlist
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from hetctl.cli import app
from hetctl.errors import HetctlError
from hetctl.files.cluster import Cluster
from hetctl.files.hostrange import MAX_NODES, count_hostlist
from hetctl.files.inventory import load_inventory
from hetctl.files.plan import Plan
from hetctl.files.yamlio import dump_yaml, load_model
from hetctl.plan.models import load_model as load_spec
from hetctl.plan.planner import plan_cluster
from hetctl.plan.candidates import Pins
from tests.test_plan_invariants import node, random_cluster

FUZZ = settings(max_examples=int(os.environ.get("HETCTL_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

INVENTORY = """\
defaults:
  transport: local
  python: python3
  env: {OMP_NUM_THREADS: 1}
  tflops: 1.5
ssh:
  config: null
  host_key_policy: strict
checkpoint_dir: /tmp/hetctl-hostile/ckpt
nodes:
  - name: node-a,node-b
    host: localhost,127.0.0.1
    workdir: /tmp/hetctl-hostile/w
    labels: {rack: r1}
  - name: node-c
    host: localhost
    port: 2222
"""


def cluster_obj() -> Cluster:
    return Cluster(inventory="inventory.yaml", nodes=[
        node("node-a", "cpu", "cpu", 1, 16.0, None, None, override=1.0),
        node("node-b", "cpu", "cpu", 1, 16.0, None, None, override=1.0),
        node("node-c", "cpu", "cpu", 1, 16.0, None, None, override=1.0),
    ])


@functools.cache
def _plan_json() -> str:
    plan = plan_cluster(cluster_obj(), load_spec("tiny"), pins=Pins(pp=3, dp=1), cluster_path="cluster.yaml")
    return plan.model_copy(update={"plan_time_s": 0.0}).model_dump_json()  # the same text on every call


def plan_data() -> dict[str, Any]:
    return json.loads(_plan_json())


def cluster_data() -> dict[str, Any]:
    return cluster_obj().model_dump(mode="json")


LOADERS: dict[str, Callable[[Path], Any]] = {
    "inventory": load_inventory,
    "cluster": lambda p: load_model(p, Cluster, "cluster file"),
    "plan": lambda p: load_model(p, Plan, "plan"),
}
VALID: dict[str, Callable[[], str]] = {
    "inventory": lambda: INVENTORY,
    "cluster": lambda: dump_yaml(cluster_data()),
    "plan": lambda: dump_yaml(plan_data()),
}


def loads_or_one_line(kind: str, path: Path) -> HetctlError | None:
    """Load ``path``; return None on success, else the HetctlError after checking it is one line naming the file.

    Any other exception propagates and fails the test.
    """
    try:
        LOADERS[kind](path)
    except HetctlError as e:
        text = str(e)  # the message and the hint, as the CLI prints them
        assert text.splitlines() == [text], f"not one line: {text!r}"
        assert e.message.startswith(str(path)), f"does not name the file first: {e.message!r}"
        assert e.exit_code == 2
        return e
    return None


def write(tmp_path: Path, text: str | bytes, name: str = "f.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def error_of(kind: str, path: Path) -> HetctlError:
    e = loads_or_one_line(kind, path)
    assert e is not None, f"{path.read_text()!r} was accepted"
    return e


# --- fuzzing -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(LOADERS))
def test_the_valid_files_load(tmp_path, kind):
    assert loads_or_one_line(kind, write(tmp_path, VALID[kind]())) is None


@pytest.mark.parametrize("kind", list(LOADERS))
@FUZZ
@given(data=st.binary(max_size=600))
def test_fuzz_any_bytes(tmp_path, kind, data):
    loads_or_one_line(kind, write(tmp_path, data))


@pytest.mark.parametrize("kind", list(LOADERS))
@FUZZ
@given(data=st.data())
def test_fuzz_bytes_spliced_into_a_valid_file(tmp_path, kind, data):
    raw = bytearray(VALID[kind]().encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        cut = data.draw(st.integers(0, 8))
        raw[at:at + cut] = data.draw(st.binary(max_size=8))
    loads_or_one_line(kind, write(tmp_path, bytes(raw)))


YAML_TOKENS = [
    "nodes", "host", "name", "hots", "defaults", "ssh", "config", "tflops", "port", "env", "labels", "workdir",
    "transport", "local", "chips", "index", "vendor", "cpu", "stages", "ranks", "layers", "model", "parallel",
    ":", ": ", "- ", "-", "\n", "\n  ", "\n    ", " ", "[", "]", "{", "}", ",", "'", '"', "#", "&a", "*a", "<<",
    "!!int", "!!str", "!", "|", ">", "?", "%YAML 1.1", "---", "...", "~", "null", "true", "0", "-1", "1e400",
    ".inf", "-.inf", ".nan", "0x1F", "1:30", "2020-13-01", "[1-99999]", "a\\nb", "\\0", "\t", "\u2028", "\x85",
    "é", "\ufeff", "9" * 30,
]


@pytest.mark.parametrize("kind", list(LOADERS))
@FUZZ
@given(text=st.lists(st.sampled_from(YAML_TOKENS), max_size=60).map("".join))
def test_fuzz_yaml_like_text(tmp_path, kind, text):
    loads_or_one_line(kind, write(tmp_path, text))


HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**18, max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["a\nb", "x;rm -rf ~", "$(id)", "-oProxyCommand=id", "node a", "a\x00b", "a\x1b[31m",
                     "gpu-[1-9999999]", "a[1-999]b[1-999]", "[/]", "~", "~other/x", "../../etc", ""]),
    st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(value: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*at, i))
    return out


def _mutate(doc: Any, data: st.DataObject) -> Any:
    """Replace, delete, duplicate or add one thing somewhere in ``doc`` (a copy)."""
    doc = copy.deepcopy(doc)
    path = data.draw(st.sampled_from(_paths(doc)))
    if not path:
        return data.draw(HOSTILE_VALUES)
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    action = data.draw(st.sampled_from(["replace", "delete", "duplicate", "add"]))
    if action == "replace":
        parent[key] = data.draw(HOSTILE_VALUES)
    elif action == "delete":
        del parent[key]
    elif action == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif isinstance(parent, dict):
        parent[data.draw(st.sampled_from(["hots", "nmae", "extra", "Host", "tflop"]))] = data.draw(HOSTILE_VALUES)
    return doc


# Parsed once, and written with libyaml where PyYAML has it (the same YAML as the pure-Python dumper's):
# the pure-Python parser and dumper were most of this fuzzer's time, not hetctl's loaders.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


@functools.cache
def _valid_doc(kind: str) -> Any:
    return yaml.load(VALID[kind](), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (a safe loader)


@pytest.mark.parametrize("kind", list(LOADERS))
@FUZZ
@given(data=st.data())
def test_fuzz_structured_mutations_of_a_valid_file(tmp_path, kind, data):
    doc = copy.deepcopy(_valid_doc(kind))
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutate(doc, data)
    loads_or_one_line(kind, write(tmp_path, yaml.dump(doc, Dumper=_DUMPER, allow_unicode=True)))


@FUZZ
@given(pattern=st.lists(st.sampled_from(["a", "b", "-", "0", "1", "9", "01", "[", "]", ",", "1-3", "0-9", "5-2"]),
                        max_size=14).map("".join))
def test_count_hostlist_bounds_what_hostlist_expands(pattern):
    try:
        names = hostlist.expand_hostlist(pattern, allow_duplicates=True)
    except (hostlist.BadHostlist, ValueError):
        return
    assert count_hostlist(pattern) == len(names) >= len(hostlist.expand_hostlist(pattern))


def test_planner_plans_pass_the_load_time_checks():
    """The checks refuse hand-edited plans only: everything the planner writes passes them."""
    rng = random.Random(17)
    checked = 0
    for _ in range(12):
        try:
            plan = plan_cluster(random_cluster(rng), load_spec("llama2-7b"), global_batch=256, framework="megatron")
        except HetctlError:
            continue
        plan.check_consistency()
        checked += 1
    assert checked >= 6


# --- regressions, one per item ---------------------------------------------------------

runner = CliRunner()


def cli(*args: str) -> Any:
    """The real CLI in-process; an escaped exception would show as result.exception other than SystemExit."""
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


def test_non_utf8_inventory_names_file_and_line(tmp_path):
    p = write(tmp_path, b"nodes:\n  - host: caf\xe9\n", "inventory.yaml")
    e = error_of("inventory", p)
    assert e.message == f"{p}:2: not UTF-8 text (byte 0xe9)"
    r = cli("probe", "-i", str(p))
    assert r.exit_code == 2 and "not UTF-8" in r.output


@pytest.mark.parametrize("port", ["abc", "70000", "-1"])
def test_bad_port_in_the_ssh_config_names_its_file_and_line(tmp_path, port):
    """ssh reads the ssh config itself (issue 8): its own refusal, naming file and line, is one line and no traceback."""
    from hetctl.remote.sshconfig import effective_settings

    cfg = write(tmp_path, f"Host *\n  User me\n  Port {port}\n", "ssh_config")
    p = write(tmp_path, f"ssh:\n  config: {cfg}\nnodes:\n  - host: gpu-1\n", "inventory.yaml")
    inv = load_inventory(p)
    with pytest.raises(HetctlError) as info:
        effective_settings(inv.nodes[0], inv.ssh)
    e = info.value
    assert e.exit_code == 2 and str(e).splitlines() == [str(e)]
    assert e.message.startswith(f"gpu-1: ssh cannot use its configuration: {cfg} line 3: ")
    r = cli("probe", "-i", str(p), "--json")
    assert r.exit_code == 1 and f"{cfg} line 3: " in r.output  # the node's row says why; the others would answer


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "-1", "0", "1e400", "2000000"])
def test_bad_inventory_tflops_are_refused(tmp_path, value):
    p = write(tmp_path, f"nodes:\n  - host: a\n    tflops: {value}\n", "inventory.yaml")
    assert error_of("inventory", p).message.startswith(f"{p}:3: nodes[0].tflops: ")
    p = write(tmp_path, f"defaults:\n  tflops: {value}\nnodes:\n  - host: a\n", "inventory.yaml")
    assert error_of("inventory", p).message.startswith(f"{p}:2: defaults.tflops: ")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -5.0, 0.0])
@pytest.mark.parametrize("where", ["tflops_override", "chip tflops", "measured", "memory"])
def test_bad_cluster_figures_are_refused(tmp_path, value, where):
    doc = cluster_data()
    n = doc["nodes"][1]
    if where == "tflops_override":
        n["tflops_override"], key = value, "nodes[1].tflops_override"
    elif where == "chip tflops":
        n["chips"][0]["tflops"]["bf16"], key = value, "nodes[1].chips[0].tflops.bf16"
    elif where == "measured":
        n["chips"][0]["measured_tflops"], key = {"fp32": value}, "nodes[1].chips[0].measured_tflops.fp32"
    else:
        if value == 0.0:
            return  # a chip may report no memory; only negative and non-finite sizes are wrong
        n["memory_gb"], key = value, "nodes[1].memory_gb"
    p = write(tmp_path, dump_yaml(doc), "cluster.yaml")
    assert f": {key}: " in error_of("cluster", p).message


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "null\n"])
def test_empty_plan_is_exit_2(tmp_path, text):
    (tmp_path / "plan").mkdir()
    p = write(tmp_path / "plan", text, "plan.yaml")
    assert error_of("plan", p).message == f"{p}: plan is empty"
    r = cli("launch", str(tmp_path / "plan"), "--dry-run")
    assert r.exit_code == 2 and "plan is empty" in r.output


@pytest.fixture
def cluster_file(tmp_path) -> Path:
    return write(tmp_path, dump_yaml(cluster_data()), "cluster.yaml")


@pytest.mark.parametrize("args, needle", [
    (["--global-batch", "1000000000000000"], "--global-batch 1000000000000000: more than 16,777,216"),
    (["--global-batch", "65537", "--micro-batch", "1", "--pp", "1"], "more than 65,536 micro-batches"),
    (["--seq-len", "1000000000000"], "--seq-len 1000000000000: must be between 1 and"),
    (["--dp", "10000000"], "--dp 10000000: must be between 1 and"),
    (["--micro-batch", "0"], "--micro-batch"),
])
def test_absurd_plan_options_are_one_line_exit_2(tmp_path, cluster_file, args, needle):
    r = cli("plan", "-c", str(cluster_file), "-m", "tiny", "-o", str(tmp_path / "out"), *args)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["--steps", "1000000000000000"], ["--grace", "inf"], ["--grace", "nan"],
                                  ["--hang-timeout", "inf"], ["--node-timeout", "nan"], ["--max-restarts", "10**9"],
                                  ["--checkpoint-every", "-1"]])
def test_absurd_launch_options_are_refused(tmp_path, args):
    r = cli("launch", str(tmp_path), "--dry-run", *args)
    assert r.exit_code == 2 and "Invalid value" in r.output


def billion_laughs(levels: int = 9) -> str:
    out = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, levels + 1):
        prev, cur = chr(96 + i), chr(97 + i)
        out += f"{cur}: &{cur} [{', '.join([f'*{prev}'] * 9)}]\n"
    return out


@pytest.mark.parametrize("kind", list(LOADERS))
def test_alias_bomb_is_refused_before_anything_is_built(tmp_path, kind):
    p = write(tmp_path, billion_laughs(9))
    e = error_of(kind, p)
    assert e.message == f"{p}:7: YAML aliases expand this to more than 4,000,000 values"


@pytest.mark.parametrize("text, line", [("a: &a [*a]\n", 1), ("a: &a {b: [1, {c: *a}]}\n", 1),
                                        ("x: 1\nnodes: &n\n  - host: a\n    more: *n\n", 2)])
def test_an_alias_inside_its_own_anchor_is_refused(tmp_path, text, line):
    p = write(tmp_path, text, "inventory.yaml")
    assert error_of("inventory", p).message == f"{p}:{line}: a YAML alias refers to a node that contains it"


def test_aliases_past_the_depth_limit_once_expanded_are_refused(tmp_path):
    """Each anchor nests the one before: 70 hops, each written 2 levels deep, expand 140 levels deep."""
    text = "a0: &a0 [x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 70))
    p = write(tmp_path, text, "inventory.yaml")
    assert "nested more than 64 levels deep once aliases are expanded" in error_of("inventory", p).message


def test_aliases_and_merge_keys_are_accepted(tmp_path):
    p = write(tmp_path, "defaults: {}\nx-common: &d {python: python3, port: 2222}\nnodes:\n"
                        "  - {host: a, <<: *d}\n  - {host: b, <<: *d, port: 22}\n", "inventory.yaml")
    e = loads_or_one_line("inventory", p)
    assert e is not None and e.message == f"{p}:2: x-common: unknown key"  # the anchor's own key is still checked
    p = write(tmp_path, "defaults: &d {python: python3, port: 2222}\nnodes:\n"
                        "  - {host: a, <<: *d}\n  - {host: b, <<: *d, port: 22}\n", "inventory.yaml")
    inv = load_inventory(p)
    assert [(n.python, n.port) for n in inv.nodes] == [("python3", 2222), ("python3", 22)]


@pytest.mark.parametrize("text, needle", [
    ("nodes: " + "[" * 100_000 + "]" * 100_000 + "\n", ":1: nested more than 64 levels deep"),
    ("nodes:\n" + "- " * 100_000 + "x\n", ":2: nested more than 64 levels deep"),
    ("nodes:\n  - host: !!python/object/apply:os.system [id]\n", ":2: YAML tag"),
    ("nodes:\n  - host: a\n    port: " + "9" * 5000 + "\n", ":3: a value cannot be read: Exceeds the limit"),
    ("nodes:\n  - host: a\x00\n", ":2: not valid YAML: character #x0000 is not allowed"),
    ("nodes:\n  - host: a\n    labels: {day: 2020-13-01}\n", None),  # a date-like string, not a crash
])
def test_yaml_that_crashed_parsers_is_one_line(tmp_path, text, needle):
    p = write(tmp_path, text, "inventory.yaml")
    e = loads_or_one_line("inventory", p)
    if needle is None:
        assert e is None
    else:
        assert e is not None and e.message.startswith(f"{p}{needle}"), e


@pytest.mark.parametrize("host, total", [
    ("gpu-[1-9999999]", 9_999_999),
    ("a[1-999]b[1-999]", 998_001),
    ("g-[" + ",".join(["1-99999"] * 30) + "]", 2_999_970),
    (",".join(f"g{i}-[1-99999]" for i in range(50)), 4_999_950),
    ("g-[1-" + "9" * 5000 + "]", None),
])
def test_ranges_past_the_cap_are_refused_before_expanding(tmp_path, host, total):
    p = write(tmp_path, f"nodes:\n  - host: a\n  - host: '{host}'\n", "inventory.yaml")
    e = error_of("inventory", p)
    assert e.message.startswith(f"{p}:3: nodes[1].host: the ranges up to here name ")
    assert f"at most {MAX_NODES:,}" in e.message
    if total is not None:
        assert f"name {total + 1:,} nodes" in e.message


def test_node_cap_counts_all_entries_together(tmp_path):
    entries = "".join(f"  - host: 'r{i}-[1-30000]'\n" for i in range(4))
    p = write(tmp_path, "nodes:\n" + entries, "inventory.yaml")
    assert error_of("inventory", p).message.startswith(f"{p}:5: nodes[3].host: the ranges up to here name 120,000")


UNSAFE_NAMES = ["a\n", "a\r", "a b", "a\tb", "a;id", "$(id)", "`id`", "a|b", "a&b", "a>b", "-oProxyCommand=id",
                "a\x1b[31m", "a'b", 'a"b', "a/b", "*", "a\u2028b", "é"]


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_unsafe_node_names_are_refused(tmp_path, name):
    quoted = yaml.safe_dump(name).removesuffix("\n...\n").strip()
    p = write(tmp_path, f"nodes:\n  - host: a\n    name: {quoted}\n", "inventory.yaml")
    assert error_of("inventory", p).message.startswith(f"{p}:3: nodes[0].name: ")
    p = write(tmp_path, f"nodes:\n  - host: {quoted}\n", "inventory.yaml")
    assert error_of("inventory", p).message.startswith(f"{p}:2: nodes[0].host: ")
    doc = cluster_data()
    doc["nodes"][0]["name"] = name
    p = write(tmp_path, dump_yaml(doc), "cluster.yaml")
    assert ": nodes[0].name: " in error_of("cluster", p).message
    doc = plan_data()
    doc["ranks"][0]["node"] = name
    p = write(tmp_path, dump_yaml(doc), "plan.yaml")
    assert ": ranks[0].node: " in error_of("plan", p).message


def test_safe_names_and_hosts_still_load(tmp_path):
    p = write(tmp_path, "nodes:\n  - {host: 'gpu_01.rack-2.example.org'}\n  - {name: 'n:1', host: 'fe80::1%eth0'}\n"
              "  - {host: '10.0.0.[1-3]'}\n", "inventory.yaml")
    assert load_inventory(p).names == ["gpu_01.rack-2.example.org", "n:1", "10.0.0.1", "10.0.0.2", "10.0.0.3"]


def test_duplicate_nodes_and_chips_in_a_cluster_file(tmp_path):
    doc = cluster_data()
    doc["nodes"].append(copy.deepcopy(doc["nodes"][0]))
    p = write(tmp_path, dump_yaml(doc), "cluster.yaml")
    e = error_of("cluster", p)
    assert ": nodes[3].name: node 'node-a' is listed twice (also nodes[0])" in e.message
    doc = cluster_data()
    doc["nodes"][1]["chips"].append(copy.deepcopy(doc["nodes"][1]["chips"][0]))
    p = write(tmp_path, dump_yaml(doc), "cluster.yaml")
    e = error_of("cluster", p)
    assert ": nodes[1].chips[1].index: node node-b: cpu chip index 0 is listed twice (also chips[0])" in e.message
    r = cli("plan", "-c", str(p), "-m", "tiny", "-o", str(tmp_path / "out"))
    assert r.exit_code == 2 and "listed twice" in r.output


def test_same_index_on_two_vendors_of_one_node_is_fine(tmp_path):
    doc = cluster_data()
    chip = dict(doc["nodes"][0]["chips"][0], vendor="nvidia", model="NVIDIA H100 80GB HBM3")
    doc["nodes"][0]["chips"].append(chip)
    assert loads_or_one_line("cluster", write(tmp_path, dump_yaml(doc))) is None


def _edit_layers(doc: dict, spans: list[list[int]]) -> None:
    for stage, span in zip(doc["stages"], spans):
        stage["layers"] = span


# tiny has 8 layers; the valid plan's stages are pp 3 on one replica.
@pytest.mark.parametrize("spans, loc, needle", [
    ([[0, 4], [3, 6], [6, 8]], "stages[1].layers", "overlaps the previous stage (which ends at 4)"),
    ([[0, 3], [4, 6], [6, 8]], "stages[1].layers", "leaves layers 3..3 in no stage"),
    ([[0, 3], [3, 6], [6, 7]], "stages[2].layers", "replica 0 ends at layer 7, but the model has 8"),
    ([[0, 3], [3, 9], [9, 12]], "stages[2].layers", "ends at layer 12, but the model has 8"),
    ([[0, 3], [3, 3], [3, 8]], "stages[1].layers", "[3, 3) holds no layer"),
    ([[0, 5], [5, 4], [4, 8]], "stages[1].layers", "[5, 4) holds no layer"),
    ([[1, 3], [3, 6], [6, 8]], "stages[0].layers", "must start at layer 0"),
])
def test_plan_with_bad_layers_is_refused(tmp_path, spans, loc, needle):
    doc = plan_data()
    _edit_layers(doc, spans)
    p = write(tmp_path, dump_yaml(doc), "plan.yaml")
    e = error_of("plan", p)
    assert f": {loc}: " in e.message and needle in e.message, e.message


def _ranks(edit: Callable[[dict], None]) -> dict:
    doc = plan_data()
    edit(doc)
    return doc


@pytest.mark.parametrize("doc, loc, needle", [
    (_ranks(lambda d: d["ranks"][2].update(rank=5)), "ranks[2].rank", "numbered 0..2"),
    (_ranks(lambda d: d["ranks"][2].update(rank=0)), "ranks[0].rank", "once each"),
    (_ranks(lambda d: d["ranks"].pop()), "ranks", "2 ranks, but the stages hold 3 chips"),
    (_ranks(lambda d: d["ranks"].append(dict(d["ranks"][0], rank=3, local_rank=1))), "ranks",
     "4 ranks, but the stages hold 3 chips"),
    (_ranks(lambda d: d["ranks"][1].update(node="node-c", local_rank=1)), "ranks[1].node",
     "rank 1 is on node-c, but its stage runs on node-b"),
    (_ranks(lambda d: d["ranks"][1].update(chip=3)), "ranks[1].chip", "chip 3 is not one of its stage's chips [0]"),
    (_ranks(lambda d: d["ranks"][1].update(stage=7)), "ranks[1].stage", "replica 0 has no stage 7"),
    (_ranks(lambda d: d["ranks"][1].update(local_rank=4)), "ranks[1].local_rank", "local ranks [4] are not 0..0"),
    (_ranks(lambda d: d["stages"][2].update(stage=1)), "stages[2].stage", "replica 0 has stages [0, 1, 1]"),
    (_ranks(lambda d: d["parallel"].update(dp=2, global_batch=d["parallel"]["global_batch"] * 2)), "parallel.dp",
     "dp is 2 but the stages name replicas [0]"),
    (_ranks(lambda d: d["parallel"].update(global_batch=7)), "parallel.global_batch", "7 is not micro_batch"),
    (_ranks(lambda d: d["stages"][1].update(chips=[0, 1])), "stages[1].chips", "2 chip(s) for tp 1"),
    (_ranks(lambda d: d["nodes"].append("node-z")), "nodes", "but the ranks run on"),
])
def test_plan_with_an_inconsistent_rank_table_is_refused(tmp_path, doc, loc, needle):
    p = write(tmp_path, dump_yaml(doc), "plan.yaml")
    e = error_of("plan", p)
    assert f": {loc}: " in e.message and needle in e.message, e.message


def test_two_ranks_on_one_chip_is_refused(tmp_path):
    doc = plan_data()
    for stage in doc["stages"][1:]:
        stage["node"] = "node-a"
    for r in doc["ranks"][1:]:
        r["node"] = "node-a"
    p = write(tmp_path, dump_yaml(doc), "plan.yaml")
    assert "chip 0 of node node-a is also in stages[0]" in error_of("plan", p).message


@pytest.fixture
def launchable(tmp_path) -> tuple[Path, Path]:
    """A plan folder and the local inventory it names."""
    inv = write(tmp_path, INVENTORY.replace("/tmp/hetctl-hostile", str(tmp_path)), "inventory.yaml")
    doc = plan_data()
    doc["inventory"] = str(inv)
    (tmp_path / "plan").mkdir()
    write(tmp_path / "plan", dump_yaml(doc), "plan.yaml")
    return tmp_path / "plan", inv


def test_hand_edited_plan_is_refused_by_launch_with_exit_2(launchable, tmp_path):
    plan_dir, _ = launchable
    assert cli("launch", str(plan_dir), "--dry-run").exit_code == 0
    doc = yaml.safe_load((plan_dir / "plan.yaml").read_text())
    _edit_layers(doc, [[0, 4], [3, 6], [6, 8]])
    (plan_dir / "plan.yaml").write_text(dump_yaml(doc))
    r = cli("launch", str(plan_dir), "--steps", "2", "--run-dir", str(tmp_path / "runs"))
    assert r.exit_code == 2 and "stages[1].layers" in r.output
    assert not (tmp_path / "runs").exists()


def test_plan_node_missing_from_the_inventory_is_exit_2_naming_it(launchable, tmp_path):
    plan_dir, inv = launchable
    inv.write_text(inv.read_text().replace("name: node-c", "name: node-x"))
    r = cli("launch", str(plan_dir), "--steps", "2", "--run-dir", str(tmp_path / "runs"))
    assert r.exit_code == 2, r.output
    assert "node 'node-c' of the plan is not in the inventory" in r.output
    assert not (tmp_path / "runs").exists()


def test_misspelt_key_is_reported_first_with_the_closest_known_key(tmp_path):
    p = write(tmp_path, "nodes:\n  - hots: a\n", "inventory.yaml")
    e = error_of("inventory", p)
    assert e.message == f"{p}:2: nodes[0].hots: unknown key, did you mean host?"
    p = write(tmp_path, "defaults:\n  pyhton: python3\nnodes:\n  - host: a\n    tflosp: 3\n", "inventory.yaml")
    assert error_of("inventory", p).message == f"{p}:2: defaults.pyhton: unknown key, did you mean python? " \
                                               "(and 1 more problem)"
    doc = plan_data()
    doc["stages"][0]["layer"] = doc["stages"][0].pop("layers")
    p = write(tmp_path, dump_yaml(doc), "plan.yaml")
    line = next(i for i, text in enumerate(p.read_text().splitlines(), 1) if text.strip().startswith("layer:"))
    assert error_of("plan", p).message.startswith(f"{p}:{line}: stages[0].layer: unknown key, did you mean layers?")
    p = write(tmp_path, "nodes:\n  - host: a\n    zzz: 1\n", "inventory.yaml")
    assert error_of("inventory", p).message == f"{p}:3: nodes[0].zzz: unknown key"


def test_errors_through_python_m_hetctl_are_one_line_exit_2(tmp_path):
    """Once through a real process: exit code 2 and no traceback on stderr."""
    p = write(tmp_path, billion_laughs(9), "inventory.yaml")
    r = subprocess.run([sys.executable, "-m", "hetctl", "probe", "-i", str(p)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[0] == f"error: {p}:7: YAML aliases expand this to more than 4,000,000 values"


@pytest.mark.parametrize("figure", [float("inf"), float("nan"), 0.0, -3.0])
def test_unusable_bench_figures_from_a_node_are_left_out_not_a_crash(figure):
    """A node's benchmark report is outside input too: a figure the cluster file would refuse is not recorded."""
    from hetctl.files.cluster import Chip, NodeFacts
    from hetctl.probe import assemble

    facts = NodeFacts(name="n1", host="h", chips=[Chip(index=0, vendor="cpu")], software={"torch": "2.4.0"})
    report = {"error": None, "results": [{"ordinal": 0, "tflops": {"fp32": figure}, "errors": {}}]}
    out = assemble.apply_bench(facts, report)
    assert out.chips[0].measured_tflops is None
    assert out.bench_error.startswith("chip 0: unusable figures")


@pytest.mark.parametrize("snippet, key", [("port: true", "nodes[0].port"), ("tflops: true", "nodes[0].tflops"),
                                          ("port: '22'", "nodes[0].port")])
def test_booleans_and_strings_are_not_numbers(tmp_path, snippet, key):
    p = write(tmp_path, f"nodes:\n  - host: a\n    {snippet}\n", "inventory.yaml")
    assert error_of("inventory", p).message.startswith(f"{p}:3: {key}: Input should be a valid")

"""``hetctl demo``: the whole flow on this machine, for a first look.

The text it trains on ships with hetctl (``hetctl/data/corpus/tinyshakespeare.txt``,
its source in ``SOURCE.md``): ``hetctl data prepare`` with the bytes tokenizer
writes it once into the demo folder as a Megatron indexed dataset, and every rank
reads its own samples from it. Three "nodes" with ``transport: local`` share this machine. Each step is the real
one: the probe collector runs on every node and times the ``tiny`` model's layer
there (a layer profile, as ``probe --model tiny``; the three take turns, since
they share this machine's CPUs), the planner plans ``tiny`` as a 3-stage pipeline
from those measured figures (``plan/plan.yaml`` and ``plan/nodes/*.sh``), and the
launch goes through the per-node agents. The inventory claims no speeds: a claim
the nodes do not live up to is what the straggler check reports, and a healthy
demo has none; the run's summary compares its measured step with the plan's.
At the end the run is exported as a Hugging Face folder and ``transformers``
(when installed) generates a few lines from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hetctl.errors import ConfigError, RemoteError
from hetctl.files.plan import Plan
from hetctl.files.yamlio import dump_yaml, save_model, written_by

DEMO_NODES = ("node-a", "node-b", "node-c")
DEMO_MODEL = "tiny"
CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "tinyshakespeare.txt"
PROMPT = "ROMEO:\n"


def _written_by_demo(path: Path) -> bool:
    """Whether ``path`` is one of the demo's own files (it heads each with a ``hetctl demo`` line)."""
    return written_by(path, "hetctl demo")


def write_inventory(directory: str | Path) -> Path:
    """Write ``<directory>/inventory.yaml``: three local nodes, this interpreter, one thread per rank.

    The interpreter running hetctl is the nodes' ``python``, so the ranks find the
    same torch and hetctl. Paths are relative to the folder (the inventory rule).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    inv = {
        "kind": "inventory",
        "defaults": {"transport": "local", "python": sys.executable, "env": {"OMP_NUM_THREADS": "1"}},
        "checkpoint_dir": "checkpoints",
        "nodes": [{"name": name, "host": "localhost", "workdir": f"nodes/{name}", "labels": {"demo": "true"}}
                  for name in DEMO_NODES],
    }
    path = d / "inventory.yaml"
    header = "# written by `hetctl demo`: three nodes on this machine, their speeds measured by the probe\n"
    # A demo folder is one whose inventory the demo wrote; anywhere else, never overwrite a user's files.
    theirs = [path] if path.exists() and not _written_by_demo(path) else \
        [p for p in (d / "cluster.yaml", d / "plan" / "plan.yaml") if p.exists() and not path.exists()]
    if theirs:
        raise ConfigError(f"{theirs[0]}: exists and was not written by `hetctl demo`",
                          "pass --dir with a new folder (or an earlier demo's); nothing was changed")
    path.write_text(header + dump_yaml(inv))
    return path


def shared_cpus_note(ranks: int, step_ratio: float) -> str:
    """Why the demo's measured step is not its planned one: its nodes are one machine.

    The probe timed each node's layer alone, one thread at a time; in the run the
    ranks, their warm spares (importing torch) and the controller share this machine's
    CPUs, and each point-to-point message waits for a CPU too. The plan assumes a
    machine per node, as on a real cluster.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return (f"why {step_ratio:.3g}×: the demo's {ranks} nodes are this one machine, so its {ranks} ranks, their warm "
            f"spares and the controller share {cpus} CPU{'s' if cpus != 1 else ''}, where the plan took each node's "
            "speed as the probe measured it alone (a machine per node, as on a real cluster); "
            "`hetctl plan --calibrate` prices what this machine really did")


def probe_nodes(inventory_path: Path) -> tuple[Any, Any]:
    """Load the demo inventory and probe it with the layer profile of ``tiny``; every node must answer
    and be profiled (the plan is made from those figures)."""
    from hetctl.files.inventory import load_inventory
    from hetctl.plan.models import default_micro_batch, load_model
    from hetctl.probe.assemble import ProfileShape
    from hetctl.probe.gather import probe

    inv = load_inventory(inventory_path)
    spec = load_model(DEMO_MODEL)
    cluster = probe(inv, profile=ProfileShape(spec=spec.model_dump(), micro_batch=default_micro_batch(spec)))
    cluster.inventory = str(inventory_path.resolve())
    down = [n for n in cluster.nodes if not n.reachable]
    if down:
        raise RemoteError(f"demo node {down[0].name} did not answer the probe: {down[0].error}",
                          "check that python3 runs here", node=down[0].name)
    unmeasured = [n for n in cluster.nodes if not any(c.profile for c in n.chips)]
    if unmeasured:
        n = unmeasured[0]
        raise RemoteError(f"demo node {n.name}: no layer profile of {DEMO_MODEL}: {n.bench_error or 'no chip to time'}",
                          f"the demo trains with torch: `{sys.executable} -m pip install torch==2.13.0`", node=n.name)
    save_model(inventory_path.parent / "cluster.yaml", cluster, header="hetctl demo: probed")
    return inv, cluster


def plan_tiny(directory: str | Path, cluster: Any, stages: int = 3) -> tuple[Plan, Path]:
    """Plan the ``tiny`` preset as a ``stages``-stage pipeline; write ``<directory>/plan/``."""
    from hetctl.plan.models import load_model
    from hetctl.plan.planner import plan_cluster
    from hetctl.plan.render import write_plan_dir
    from hetctl.plan.candidates import Pins

    cluster_path = Path(directory) / "cluster.yaml"
    plan = plan_cluster(cluster, load_model(DEMO_MODEL), pins=Pins(pp=stages, dp=1),
                        cluster_path=cluster_path)
    written = write_plan_dir(plan, Path(directory) / "plan", hosts={n.name: n.host for n in cluster.nodes})
    return plan, written[0]


def prepare_text(directory: str | Path) -> tuple[Path, Any]:
    """The shipped corpus as ``<directory>/data/shakespeare.{bin,idx}`` (bytes tokenizer): the dataset's
    prefix, and :func:`hetctl.corpus.prepare.prepare`'s report (``None`` when an earlier demo wrote it)."""
    from hetctl.corpus.prepare import Options, prepare
    from hetctl.corpus.tokenize import byte_tokenizer

    prefix = Path(directory).resolve() / "data" / "shakespeare"
    if all(prefix.with_suffix(s).is_file() for s in (".bin", ".idx")):
        return prefix, None
    if not CORPUS.is_file():
        raise ConfigError(f"{CORPUS}: the demo's text is missing from this installation",
                          "reinstall hetctl (`pip install -e '.[dev]'` from a clone)")
    return prefix, prepare(Options((CORPUS,), prefix), byte_tokenizer())


def generate(folder: Path, prompt: str = PROMPT, tokens: int = 120, seed: int = 0) -> str | None:
    """``tokens`` bytes that ``transformers`` samples from the exported model after ``prompt``, as text;
    ``None`` without ``transformers``. Sampled (temperature 0.8, top 40, seeded): greedy decoding of a
    briefly trained model repeats one word."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    ids = torch.tensor([list(prompt.encode("utf-8"))])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=True,
                             temperature=0.8, top_k=40, pad_token_id=256, eos_token_id=256)
    return bytes(t for t in out[0].tolist() if t < 256).decode("utf-8", "replace")

"""Hugging Face interop of the reference trainer's model, against transformers itself.

The architecture (RoPE with llama3 scaling, norm eps, GQA, q/k/v biases, tied
head) is checked by logits: a random transformers model saved with
``save_pretrained``, imported by ``--init-from``'s loader, must give the same
logits in hetctl's units. The name mapping is checked by round trips; config
refusals and mismatched checkpoints by their one-line errors.
"""

from __future__ import annotations

import json
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hetctl.errors import ConfigError  # noqa: E402
from hetctl.plan.hfconfig import config_from_spec, load_config_spec  # noqa: E402
from hetctl.plan.models import load_model, model_cost, presets  # noqa: E402
from hetctl.train import hfconvert  # noqa: E402
from hetctl.train.hfio import load_into, read_tensors  # noqa: E402
from hetctl.train.hfweights import check, weight_files  # noqa: E402
from hetctl.train.model import StageModule, build_units  # noqa: E402
from tests.helpers.hfmodels import save_random  # noqa: E402

CASES = {
    "llama-llama3-rope": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "rope_scaling": None, "rope_theta": 10000.0}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "qwen2-untied": ("qwen2", {}),
    "mistral": ("mistral", {"num_key_value_heads": 1}),
}


def ours(folder, seq_len=16, tp=(0, 1)):
    """hetctl's whole model (one stage) from a Hugging Face folder, and its spec."""
    spec = load_config_spec(folder, seq_len=seq_len).model_dump(mode="json")
    units = build_units(spec, (0, spec["num_layers"]), True, True, seed=1)
    load_into(folder, spec, units, tp=tp)
    return StageModule(units).eval(), spec


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.mark.parametrize("case", CASES)
def test_imported_model_gives_transformers_logits(tmp_path, case):
    family, over = CASES[case]
    ref = save_random(tmp_path, family, **over)
    model, spec = ours(tmp_path)
    ids = torch.randint(0, spec["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids)
    assert rel_err(want, got) < 1e-4
    # the test can fail: the same weights without Llama 3's scaling (or with another theta) give other logits
    if case == "llama-llama3-rope":
        plain = build_units({**spec, "rope_scaling": None}, (0, spec["num_layers"]), True, True, seed=1)
        for name, unit in model.units.items():
            plain[name].load_state_dict(unit.state_dict())
        with torch.no_grad():
            assert rel_err(want, StageModule(plain)(ids)) > 1e-2


def test_sharded_checkpoint_loads_each_stage_from_its_own_shards(tmp_path):
    ref = save_random(tmp_path, "llama", shard="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    model, spec = ours(tmp_path)
    ids = torch.arange(32).reshape(2, 16) % spec["vocab_size"]
    with torch.no_grad():
        assert rel_err(ref(ids).logits, model(ids)) < 1e-4
    # a middle stage needs only its layer's tensors, and only the shards holding them
    needed = check(tmp_path, spec, ["layer-00001"])
    assert set(needed) == {k for k in index["weight_map"] if k.startswith("model.layers.1.")}
    assert set(needed.values()) < {tmp_path / f for f in index["weight_map"].values()}


def test_mapping_round_trips_both_ways(tmp_path):
    save_random(tmp_path, "qwen2")
    state = read_tensors(weight_files(tmp_path))
    units = hfconvert.from_hf(state)
    assert hfconvert.to_hf(units) == state
    assert hfconvert.from_hf(hfconvert.to_hf(units)) == units
    assert set(units["layer-00002"]) >= {"q.bias", "k.bias", "v.bias", "attn_norm.weight", "down.weight"}
    tied = hfconvert.from_hf(state, tied=True)
    assert "head" in tied and "out.weight" not in tied["head"] and "lm_head.weight" not in hfconvert.to_hf(tied, True)


def test_tensor_parallel_ranks_rebuild_the_block_with_its_biases(tmp_path):
    """TP=2: each rank's slice of an imported Qwen2 block (q/k/v biases split with their rows) joins back whole."""
    save_random(tmp_path, "qwen2")
    from hetctl.train.tensor import SHARD_DIM, shard_state

    model, spec = ours(tmp_path)
    whole = model.units["layer-00000"].state_dict()
    parts = [shard_state(whole, r, 2) for r in range(2)]
    assert parts[0]["k.bias"].shape == (whole["k.bias"].shape[0] // 2,)
    for k, v in whole.items():
        joined = torch.cat([p[k] for p in parts], SHARD_DIM[k]) if k in SHARD_DIM else parts[0][k]
        assert torch.equal(joined, v), k


def test_planner_counts_the_parameters_transformers_has(tmp_path):
    """The plan's figures follow the architecture: biases, GQA's K/V size and a tied table counted once."""
    for family, over in (("qwen2", {"tie_word_embeddings": True}), ("llama", {}), ("mistral", {})):
        ref = save_random(tmp_path / family, family, **over)
        spec = load_model(str(tmp_path / family))
        assert model_cost(spec).total_params() == sum(p.numel() for p in ref.parameters()), family


def test_presets_copy_their_public_configs():
    table = presets()
    for name, billions in (("llama3.2-1b", 1.24), ("qwen2-0.5b", 0.49), ("qwen2-72b", 72.71), ("llama3-8b", 8.03)):
        assert round(model_cost(table[name].spec).total_params() / 1e9, 2) == billions, name
        assert "config.json" in (table[name].spec.source or ""), name
    cfg = config_from_spec(table["llama3.2-1b"].spec)
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["tie_word_embeddings"] is True


def _config(tmp_path, family, **over):
    save_random(tmp_path, family)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("family, over, needle", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type 'yarn' is not supported"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type 'dynamic' is not supported"),
    ("llama", {"attention_bias": True}, "attention_bias is true"),
    ("llama", {"mlp_bias": True}, "mlp_bias is true"),
    ("llama", {"head_dim": 32}, "head_dim 32 is not hidden_size/num_attention_heads"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window is true"),
    ("mistral", {"sliding_window": 4096}, "sliding_window is 4096"),
    ("llama", {"architectures": ["GPT2LMHeadModel"]}, "architectures ['GPT2LMHeadModel'] is not one hetctl trains"),
])
def test_unrepresentable_config_is_refused_naming_the_field(tmp_path, family, over, needle):
    folder = _config(tmp_path, family, **over)
    with pytest.raises(ConfigError) as e:
        load_model(str(folder))
    assert needle in e.value.message and "\n" not in e.value.message
    assert str(folder / "config.json") in e.value.message


def test_mismatched_checkpoint_is_refused_naming_file_and_field(tmp_path):
    save_random(tmp_path / "ck", "llama")
    spec = load_config_spec(tmp_path / "ck").model_dump(mode="json")
    check(tmp_path / "ck", spec)  # the matching model passes
    cfg = tmp_path / "ck" / "config.json"
    for field, value, needle in (("num_layers", 4, "num_hidden_layers gives num_layers 3, the plan's model has 4"),
                                 ("vocab_size", 128, "vocab_size gives vocab_size 96, the plan's model has 128"),
                                 ("hidden_size", 32, "hidden_size gives hidden_size 64")):
        with pytest.raises(ConfigError) as e:
            check(tmp_path / "ck", {**spec, field: value})
        assert e.value.message.startswith(f"{cfg}: {needle}"), e.value.message
    # weights whose dtype the trainer cannot load exactly
    from safetensors.torch import save_file

    state = read_tensors(weight_files(tmp_path / "ck"))
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
    save_file(state, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.safetensors: model.layers.1.mlp.up_proj.weight has dtype I32"):
        check(tmp_path / "ck", spec)
    # a stage that does not hold layer 1 never looks at it
    check(tmp_path / "ck", spec, ["embedding", "layer-00000"])
    (tmp_path / "ck" / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        check(tmp_path / "ck", spec)


def test_init_from_reaches_the_ranks_of_a_fresh_start_only():
    """A restart from scratch re-imports; a resume from a hetctl checkpoint continues its own weights."""
    from hetctl.files.inventory import Node
    from hetctl.files.plan import Plan
    from hetctl.files.run import LaunchOptions
    from hetctl.launch import materialize as mat
    from tests.helpers.rankrunner import tiny_plan

    plan = Plan.model_validate(tiny_plan([4, 2]))
    nodes = {n: Node(name=n, host="h", python="/py", workdir="/w") for n in plan.nodes}

    def argv(resume_step: int) -> list[tuple[str, ...]]:
        spec = mat.materialize(plan, nodes, run_id="r", attempt=1, master_addr="a", master_port=1,
                               options=LaunchOptions(steps=9, checkpoint_every=3, init_from="/w/hf"),
                               resume_step=resume_step, ckpt_dir="/c")
        return [r.argv for n in spec.nodes for r in n.ranks]

    assert all(a[-2:] == ("--init-from", "/w/hf") for a in argv(0))
    assert all("--init-from" not in a for a in argv(3))


def test_export_refuses_what_is_not_a_run(tmp_path):
    from hetctl.train.export import export

    with pytest.raises(ConfigError, match="not a run folder"):
        export(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["llama-llama3-rope", "qwen2-bias-tied"])
def test_bf16_logits_agree_with_transformers_within_bf16_rounding(tmp_path, case):
    """In bf16 as the trainer computes on an accelerator (``torch.autocast`` to bfloat16, fp32 weights; here the
    CPU's autocast), hetctl's logits and transformers' (under the same autocast) differ by bf16 rounding only:
    each within 2% of the fp32 logits (bf16 keeps 8 bits of mantissa, and a few layers add up the rounding)."""
    family, over = CASES[case]
    ref = save_random(tmp_path, family, **over)
    model, spec = ours(tmp_path)
    ids = torch.randint(0, spec["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = ref(ids).logits
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            want, got = ref(ids).logits.float(), model(ids).float()
    assert rel_err(exact, want) < 2e-2 and rel_err(exact, got) < 2e-2 and rel_err(want, got) < 2e-2
    assert rel_err(exact, got) > 1e-5  # it really ran in bf16 (fp32 agrees to 1e-6)

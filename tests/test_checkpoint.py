"""Checkpoint manifests: a step without a valid manifest does not exist, and the reason is reported."""

from __future__ import annotations

import json
import os

import pytest

from hetctl.errors import ConfigError
from hetctl.node import manifest as ck

DIGEST = ck.model_digest({"num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 16, "num_attention_heads": 2,
                          "vocab_size": 32, "seq_len": 8})


def make_step(root, step, files=None, digest=DIGEST, precomputed=False):
    d = ck.step_dir(root, step)
    d.mkdir(parents=True)
    files = files or {"layer-00000.pt": os.urandom(3000), "layer-00001.pt": os.urandom(2000),
                      "state.json": json.dumps({"step": step}).encode()}
    for name, data in files.items():
        ck.write_atomic(d / name, data)
    entries = {n: ck.file_entry(b) for n, b in files.items()} if precomputed else None
    ck.write_manifest(d, step, digest, files=entries, meta={"seed": 1})
    return d


def test_written_manifest_validates_and_lists_every_file(tmp_path):
    d = make_step(tmp_path, 10)
    man = ck.read_manifest(d)
    assert man["step"] == 10 and man["model_digest"] == DIGEST and man["meta"] == {"seed": 1}
    assert set(man["files"]) == {"layer-00000.pt", "layer-00001.pt", "state.json"}
    assert man["files"]["layer-00001.pt"]["size"] == 2000
    assert ck.validate(d, DIGEST) == []
    assert sorted(p.name for p in d.iterdir()) == ["layer-00000.pt", "layer-00001.pt", "manifest.json", "state.json"]


def test_precomputed_entries_equal_hashing_the_directory(tmp_path):
    a = ck.read_manifest(make_step(tmp_path / "a", 5, files={"x.pt": b"abc" * 100}))
    b = ck.read_manifest(make_step(tmp_path / "b", 5, files={"x.pt": b"abc" * 100}, precomputed=True))
    assert a["files"] == b["files"] == {"x.pt": {"size": 300, "sha256": ck.sha256_file(tmp_path / "a/step-5/x.pt")}}


def truncate(d):
    p = d / "layer-00000.pt"
    p.write_bytes(p.read_bytes()[:1000])


def flip(d):
    p = d / "layer-00001.pt"
    data = bytearray(p.read_bytes())
    data[7] ^= 0x01
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: (d / "manifest.json").unlink(), "no manifest.json (the checkpoint was never finished)"),
    (truncate, "layer-00000.pt: 1000 bytes, manifest says 3000 (truncated?)"),
    (flip, "layer-00001.pt: sha256 mismatch (corrupted)"),
    (lambda d: (d / "state.json").unlink(), "state.json: missing"),
    (lambda d: (d / "manifest.json").write_text('{"step": 20, "fil'), "manifest.json unreadable"),
    (lambda d: d.rename(d.with_name("step-25")), None),  # handled below: step mismatch
])
def test_damaged_steps_are_skipped_with_the_reason(tmp_path, damage, reason):
    make_step(tmp_path, 10)
    newest = make_step(tmp_path, 20)
    damage(newest)
    skipped = []
    found = ck.latest_valid(tmp_path, DIGEST, on_skip=skipped.append)
    assert found == (10, tmp_path / "step-10")
    assert len(skipped) == 1 and not skipped[0].valid
    reason = reason or "manifest says step 20, directory is step-25"
    assert any(reason in p for p in skipped[0].problems), skipped[0].problems


def test_other_model_is_skipped(tmp_path):
    make_step(tmp_path, 10)
    make_step(tmp_path, 20, digest="0123456789abcdef")
    skipped = []
    assert ck.latest_valid(tmp_path, DIGEST, on_skip=skipped.append)[0] == 10
    assert "model digest 0123456789abcdef is not this model's" in skipped[0].problems[0]
    assert ck.latest_valid(tmp_path)[0] == 20  # without a digest, any model's checkpoint counts


def test_no_valid_step_and_no_directory(tmp_path):
    assert ck.latest_valid(tmp_path / "never-created") is None
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-x").mkdir()  # not a step directory: ignored
    (tmp_path / "notes.txt").write_text("")
    skipped = []
    assert ck.latest_valid(tmp_path, on_skip=skipped.append) is None
    assert [s.step for s in skipped] == [3]


def test_steps_sort_numerically_newest_first(tmp_path):
    for step in (9, 10, 100, 2):
        make_step(tmp_path, step)
    assert [s for s, _ in ck.steps(tmp_path)] == [100, 10, 9, 2]
    assert [st.step for st in ck.scan(tmp_path)] == [100, 10, 9, 2]


def test_require_manifest_and_read_verified(tmp_path):
    d = make_step(tmp_path, 10)
    assert ck.require_manifest(tmp_path, 10, DIGEST)["step"] == 10
    blobs = ck.read_verified(tmp_path, 10, ["layer-00001.pt", "state.json"], DIGEST)
    assert blobs["layer-00001.pt"] == (d / "layer-00001.pt").read_bytes()
    with pytest.raises(ConfigError, match=r"step-11: no manifest.json, so the step does not exist"):
        ck.require_manifest(tmp_path, 11)
    with pytest.raises(ConfigError, match="this plan's model is ffff"):
        ck.require_manifest(tmp_path, 10, "ffff")
    with pytest.raises(ConfigError, match="manifest does not list head.pt"):
        ck.read_verified(tmp_path, 10, ["head.pt"])
    flip(d)
    with pytest.raises(ConfigError, match=r"layer-00001.pt: size or sha256 differs from the manifest \(corrupted\)"):
        ck.read_verified(tmp_path, 10, ["layer-00001.pt"])


def test_model_digest_ignores_name_but_not_shape():
    base = {"name": "tiny", "num_layers": 6, "hidden_size": 64, "ffn_hidden_size": 172, "num_attention_heads": 4,
            "num_query_groups": None, "vocab_size": 256, "seq_len": 32}
    assert ck.model_digest(base) == ck.model_digest({**base, "name": "mine", "source": "x.yaml"})
    assert ck.model_digest(base) == ck.model_digest({**base, "num_query_groups": 4})  # None means one per head
    assert ck.model_digest(base) != ck.model_digest({**base, "hidden_size": 128})


def test_manifest_rejects_path_names(tmp_path):
    d = tmp_path / "step-1"
    d.mkdir()
    with pytest.raises(ValueError, match="bad checkpoint file name"):
        ck.write_manifest(d, 1, DIGEST, files={"../escape.pt": {"size": 1, "sha256": "0"}})
    assert not (d / "manifest.json").exists()


def test_manifest_naming_outside_files_is_invalid(tmp_path):
    d = make_step(tmp_path, 1)
    man = json.loads((d / "manifest.json").read_text())
    man["files"]["../../outside"] = {"size": 1, "sha256": "0"}
    (d / "manifest.json").write_text(json.dumps(man))
    assert any("not a file name inside the step directory" in p for p in ck.validate(d))


def test_a_step_marked_unloadable_is_skipped_with_the_ranks_reason(tmp_path):
    for step in (4, 8):
        sd = ck.step_dir(tmp_path, step)
        sd.mkdir()
        (sd / "layer-00000.pt").write_bytes(b"w" * 64)
        ck.write_manifest(sd, step, "d")
    ck.mark_unloadable(ck.step_dir(tmp_path, 8), "rank 2 on n2 exited 7: checkpoint step 8 cannot be loaded")
    skipped = []
    assert ck.latest_valid(tmp_path, "d", on_skip=skipped.append)[0] == 4
    assert skipped[0].problems == ["a rank could not load it: rank 2 on n2 exited 7: checkpoint step 8 cannot be loaded"]
    planted = ck.step_dir(tmp_path, 4) / ck.UNLOADABLE
    planted.symlink_to("/etc/passwd")  # a link is never read through, and still keeps the step from being used
    assert ck.validate(ck.step_dir(tmp_path, 4), "d") == [
        "unloadable.json: a symbolic link inside the step folder (planted?); not followed"]
    planted.unlink()
    planted.write_bytes(b"\xff not json")
    assert ck.validate(ck.step_dir(tmp_path, 4), "d") == ["a rank could not load it: reason unknown "
                                                          "(unloadable.json unreadable)"]

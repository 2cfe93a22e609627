"""The user's index of runs: a run id, or a unique prefix of one, names its folder from anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetctl.errors import ConfigError
from hetctl.files import runindex
from hetctl.files.run import RunDir


def test_a_created_run_is_found_by_its_id_and_a_unique_prefix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = RunDir.create(tmp_path / "one", "20261205-101010-aaaa")
    (a.path / "run.yaml").write_text("run_id: x\n")
    b = RunDir.create(tmp_path / "two", "20261205-101010-bbbb")
    (b.path / "run.yaml").write_text("run_id: y\n")
    assert runindex.resolve("20261205-101010-aaaa") == str(a.path.resolve())
    assert runindex.resolve("20261205-101010-b") == str(b.path.resolve())
    with pytest.raises(ConfigError, match=r"fits 2 runs: 20261205-101010-aaaa, 20261205-101010-bbbb"):
        runindex.resolve("20261205")
    # a path is a path: as given, whether or not it exists, and whatever the index holds
    assert runindex.resolve("one/20261205-101010-aaaa") == "one/20261205-101010-aaaa"
    assert runindex.resolve("nothing-like-it") == "nothing-like-it"
    # a folder that is gone is not offered
    (b.path / "run.yaml").unlink()
    assert runindex.resolve("20261205") == str(a.path.resolve())
    index = runindex.index_path()
    assert index == Path.home() / ".local" / "state" / "hetctl" / "runs" and index.is_file()
    assert oct(index.stat().st_mode & 0o777) == "0o600"


def test_the_index_follows_xdg_state_home_and_skips_lines_it_did_not_write(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run = RunDir.create(tmp_path / "runs", "20261205-121212-cccc")
    (run.path / "run.yaml").write_text("run_id: z\n")
    index = tmp_path / "state" / "hetctl" / "runs"
    with open(index, "a") as f:
        f.write("garbage\n20261205-121212-cccd\trelative/path\n\n")
    assert runindex.resolve("20261205-1212") == str(run.path.resolve())


def test_an_index_that_cannot_be_written_never_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "ro"))
    (tmp_path / "ro").mkdir()
    os.symlink("/nonexistent-target", tmp_path / "ro" / "hetctl")  # a link where the folder should be
    run = RunDir.create(tmp_path / "runs", "20261205-131313-dddd")
    assert run.path.is_dir()

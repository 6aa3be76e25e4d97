"""Staging: verified copy, atomic, idempotent, space-checked (on a real small tmpfs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from regen import weights
from regen.manifest import STAGED_COPY_RECORD
from regen.weights import StageError, stage_model, staged_path


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs: a real file system that runs out of room."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def make_model(path, weight_bytes=3_000_000):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3"}')
    (path / "tokenizer.json").write_text('{"model": {}}')
    (path / "model-00001-of-00001.safetensors").write_bytes(os.urandom(weight_bytes))
    return path


def test_stage_copies_verifies_and_a_second_stage_is_a_no_op(tmp_path):
    src = make_model(tmp_path / "Qwen3-tiny")
    first = stage_model(src, tmp_path / "shm")
    assert first.copied and first.path == staged_path(src, tmp_path / "shm")
    for name in ("config.json", "tokenizer.json", "model-00001-of-00001.safetensors"):
        assert (first.path / name).read_bytes() == (src / name).read_bytes()
    assert (first.path / STAGED_COPY_RECORD).exists()
    second = stage_model(src, tmp_path / "shm")
    assert not second.copied
    assert second.seconds < 1.0
    assert [p.name for p in (tmp_path / "shm").iterdir()] == [first.path.name]


def test_a_changed_source_is_staged_again(tmp_path):
    src = make_model(tmp_path / "m")
    stage_model(src, tmp_path / "shm")
    (src / "config.json").write_text('{"model_type": "qwen3", "changed": true}')
    again = stage_model(src, tmp_path / "shm")
    assert again.copied
    assert b"changed" in (again.path / "config.json").read_bytes()


def test_an_interrupted_copy_leaves_no_staged_model(tmp_path, monkeypatch):
    src = make_model(tmp_path / "m")
    real_copy = weights._copy_one
    calls = []

    def copy_then_die(s, d, rel):
        calls.append(rel)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the task killed mid-copy
        real_copy(s, d, rel)

    monkeypatch.setattr(weights, "_copy_one", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        stage_model(src, tmp_path / "shm", workers=1)
    assert list((tmp_path / "shm").iterdir()) == []  # no half copy, no temp dir
    monkeypatch.setattr(weights, "_copy_one", real_copy)
    assert stage_model(src, tmp_path / "shm").copied


def test_too_little_space_fails_with_needed_and_free(tmp_path, small_tmpfs):
    src = make_model(tmp_path / "big", weight_bytes=3_000_000)
    with pytest.raises(StageError) as err:
        stage_model(src, small_tmpfs / "regen")
    assert re.search(rf"staging_dir {small_tmpfs / 'regen'}: needs 3\.0 MB for big, 2\.\d MB free",
                     str(err.value)), str(err.value)
    assert [p for p in (small_tmpfs / "regen").iterdir()] == []


def test_not_a_model_directory(tmp_path):
    with pytest.raises(StageError, match="not a model directory"):
        stage_model(tmp_path, tmp_path / "shm")


def test_the_model_fingerprint_sees_retrained_weights_not_copies(tmp_path):
    from regen.manifest import model_fingerprint

    src = make_model(tmp_path / "m", weight_bytes=3_000_000)
    first = model_fingerprint(src)
    shutil.copytree(src, tmp_path / "copy")
    assert model_fingerprint(tmp_path / "copy") == first  # same model, elsewhere
    weights = src / "model-00001-of-00001.safetensors"
    weights.write_bytes(os.urandom(3_000_000))  # retrained: same size, other numbers
    assert model_fingerprint(src) != first
    assert model_fingerprint(tmp_path / "nothing") is None

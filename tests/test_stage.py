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


def left_in(staging_dir) -> list[str]:
    """What staging left in its folder, the copies' lock files aside (a lock file stays, as every
    lock file of regen does: removing one another process waits on would split the lock)."""
    return sorted(p.name for p in staging_dir.iterdir() if not p.name.endswith(".lock"))


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
    assert left_in(tmp_path / "shm") == [first.path.name]


def test_two_stagers_of_one_copy_take_turns(tmp_path, monkeypatch):
    """Two runs staging the same model on one node at once (two processes: flock is per open
    file): the second waits for the first's lock and finds the copy done, instead of removing
    the first's half copy as a leftover. The first is held inside its copy until the second is
    seen waiting on the lock file."""
    import multiprocessing
    import time

    src = make_model(tmp_path / "Qwen3-tiny", weight_bytes=1_000_000)
    shm = tmp_path / "shm"
    ctx = multiprocessing.get_context("fork")
    in_copy, release = ctx.Event(), ctx.Event()
    real_copy = weights._copy_one

    def slow_copy(*args):
        in_copy.set()
        release.wait(60)
        real_copy(*args)

    monkeypatch.setattr(weights, "_copy_one", slow_copy)
    results = ctx.Queue()

    def stage() -> None:
        result = stage_model(src, shm)
        results.put((result.copied, str(result.path)))

    first = ctx.Process(target=stage)
    first.start()
    assert in_copy.wait(60)
    monkeypatch.setattr(weights, "_copy_one", real_copy)
    second = ctx.Process(target=stage)
    second.start()
    lock = shm / f".{staged_path(src, shm).name}.lock"
    deadline = time.monotonic() + 30
    while not _waits_on(second.pid, lock):
        assert time.monotonic() < deadline, "the second stager never waited on the lock"
        time.sleep(0.05)
    release.set()
    first.join(60)
    second.join(60)
    assert (first.exitcode, second.exitcode) == (0, 0)
    assert sorted(results.get(timeout=5) for _ in range(2)) == [(False, str(staged_path(src, shm))),
                                                                (True, str(staged_path(src, shm)))]
    assert (staged_path(src, shm) / "model-00001-of-00001.safetensors").read_bytes() == \
        (src / "model-00001-of-00001.safetensors").read_bytes()


def _waits_on(pid: int, path) -> bool:
    """The process has ``path`` open and sleeps in the kernel waiting for a file lock."""
    try:
        fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        return str(path) in fds and state == "S" and "lock" in open(f"/proc/{pid}/wchan").read()
    except OSError:  # a descriptor closed while it was read
        return False


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
    assert left_in(tmp_path / "shm") == []  # no half copy, no temp dir
    monkeypatch.setattr(weights, "_copy_one", real_copy)
    assert stage_model(src, tmp_path / "shm").copied


def test_too_little_space_fails_with_needed_and_free(tmp_path, small_tmpfs):
    src = make_model(tmp_path / "big", weight_bytes=3_000_000)
    with pytest.raises(StageError) as err:
        stage_model(src, small_tmpfs / "regen")
    assert re.search(rf"staging_dir {small_tmpfs / 'regen'}: needs 3\.0 MB for big, 2\.\d MB free",
                     str(err.value)), str(err.value)
    assert left_in(small_tmpfs / "regen") == []


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

"""Staging the weights: the model copied to a RAM disk, space-checked, atomic, verified,
idempotent, one stager per copy.

The copy goes to a hidden temporary directory that is renamed into place only once every file is
copied and verified, so an interrupted copy never passes for a model. A manifest of the source
(sizes, mtimes, checksums of the small files) makes a re-stage of an unchanged model a no-op and
a changed source a fresh copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from regen.config import RunConfig
from regen.coordination import FileLock
from regen.errors import RegenError
from regen.files import sha256_file
from regen.machine import node_name
from regen.manifest import SMALL_FILE, STAGED_COPY_RECORD, Manifest, model_fingerprint
from regen.results import StagedModel
from regen.units import format_bytes

log = logging.getLogger("regen.weights")

SPACE_MARGIN = 1.02


class StageError(RegenError):
    """Staging could not be done; the message says what and where."""


@dataclass
class CopyResult:
    path: Path
    copied: bool
    bytes: int
    seconds: float


def source_manifest(src: Path) -> dict[str, dict]:
    files = {}
    for path in sorted(src.rglob("*")):
        if path.is_file() and path.name != STAGED_COPY_RECORD:
            st = path.stat()
            files[str(path.relative_to(src))] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return files


def staged_path(src: Path, staging_dir: Path) -> Path:
    """One place per source directory, so two models with the same name do not collide."""
    tag = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]
    return staging_dir / f"{src.name}-{tag}"


def _copy_one(src: Path, dst: Path, rel: str) -> None:
    (dst / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / rel, dst / rel)  # copy_file_range / sendfile under the hood


def stage_model(src: str | Path, staging_dir: str | Path, workers: int = 4) -> CopyResult:
    """One stager per copy at a time (``STAGING/.NAME.lock``): two runs staging the same model on
    one node would otherwise remove each other's half copies; the second waits, then finds the
    copy done."""
    src, staging_dir = Path(src), Path(staging_dir)
    if not (src / "config.json").is_file():
        raise StageError(f"model_path {src}: not a model directory (no config.json)")
    staging_dir.mkdir(parents=True, exist_ok=True)
    lock = staging_dir / f".{staged_path(src, staging_dir).name}.lock"
    with FileLock(lock, note=f"pid {os.getpid()} on {node_name()}"):
        return _stage_locked(src, staging_dir, lock, workers)


def _stage_locked(src: Path, staging_dir: Path, lock: Path, workers: int) -> CopyResult:
    started = time.monotonic()
    manifest = source_manifest(src)
    total = sum(f["size"] for f in manifest.values())
    dest = staged_path(src, staging_dir)
    recorded = dest / STAGED_COPY_RECORD
    if recorded.exists():
        try:
            previous = json.loads(recorded.read_text())
        except (OSError, json.JSONDecodeError):
            previous = {}
        if previous.get("source") == str(src.resolve()) and previous.get("files") == manifest:
            log.info("%s already staged at %s (%d files, %.1f MB): nothing to do",
                     src, dest, len(manifest), total / 1e6)
            return CopyResult(dest, False, total, time.monotonic() - started)
        log.info("%s changed since it was staged: staging again", src)
    for leftover in staging_dir.glob(f".{dest.name}.*"):  # a copy interrupted earlier
        if leftover != lock:
            shutil.rmtree(leftover, ignore_errors=True)
    reclaimable = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()) if dest.exists() else 0
    free = shutil.disk_usage(staging_dir).free + reclaimable
    if total * SPACE_MARGIN > free:
        raise StageError(
            f"staging_dir {staging_dir}: needs {format_bytes(total)} for {src.name}, "
            f"{format_bytes(free)} free"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=staging_dir))
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            # Largest first, so the long copies overlap instead of trailing at the end.
            order = sorted(manifest, key=lambda rel: -manifest[rel]["size"])
            list(pool.map(lambda rel: _copy_one(src, tmp, rel), order))
        checksums = verify_copy(src, tmp, manifest)
        (tmp / STAGED_COPY_RECORD).write_text(json.dumps(
            {"source": str(src.resolve()), "files": manifest, "sha256": checksums}, indent=1))
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    elapsed = time.monotonic() - started
    log.info("staged %s to %s: %d files, %.1f MB in %.1f s (%.0f MB/s)", src, dest, len(manifest),
             total / 1e6, elapsed, total / 1e6 / max(elapsed, 1e-9))
    return CopyResult(dest, True, total, elapsed)


def verify_copy(src: Path, copy: Path, manifest: dict[str, dict]) -> dict[str, str]:
    """Sizes of every file; SHA-256 of the small ones (configs, tokenizer). Raises on mismatch."""
    checksums = {}
    for rel, meta in manifest.items():
        size = (copy / rel).stat().st_size
        if size != meta["size"]:
            raise StageError(f"staged {rel}: {size} bytes, source has {meta['size']}")
        if meta["size"] <= SMALL_FILE:
            digest = sha256_file(copy / rel)
            if digest != sha256_file(src / rel):
                raise StageError(f"staged {rel}: checksum differs from the source")
            checksums[rel] = digest
    return checksums


def staged_model(cfg: RunConfig) -> StagedModel:
    """The path the servers load (the staged copy, or the source when staging is off) and its
    fingerprint, computed once, from that copy, into the run manifest."""
    if not cfg.stage_weights:
        doc = {"path": cfg.model_path, "copied": False, "bytes": 0, "seconds": 0.0,
               "summary": f"staging off: the servers load {cfg.model_path}"}
    else:
        result = stage_model(cfg.model_path, cfg.staging_dir)
        what = (f"staged {format_bytes(result.bytes)} in {result.seconds:.1f} s" if result.copied
                else "already staged")
        doc = {"path": str(result.path), "copied": result.copied, "bytes": result.bytes,
               "seconds": round(result.seconds, 3), "summary": f"{what}: {result.path}"}
    doc["fingerprint"] = model_fingerprint(doc["path"])
    Manifest(cfg.layout).update(model={"source": cfg.model_path, "path": doc["path"],
                                       "fingerprint": doc["fingerprint"]})
    return StagedModel(**doc)

"""Where a dataset lives: a local folder or an object-store prefix (``s3://``, ``gs://``), through the
few operations that hold on both without rename, append or a lock: a create-only write, a read, a
listing and a delete.

A create-only write is S3's ``If-None-Match: *`` (and the same condition on the multipart upload's
completion; a failed upload is aborted), GCS's ``ifGenerationMatch=0`` (gcsfs's ``mode="create"``),
and on a local folder a hard link of a finished temporary file, which fails when the name exists.
Whoever creates a key first owns it; a second writer learns it lost. A retried write that finds
its own bytes already there (the first try landed, its answer was lost) counts as its own.

Credentials come from where the store's own client looks (the AWS chain, ``AWS_ENDPOINT_URL``,
GCP's application default): never from a Param, a log line or a row.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from regen.errors import DataError
from regen.files import atomic_path, fsync_dir

META = "_regen"  # the keys of the part protocol (regen.parts) beside data/
_URL = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<rest>.*)$")
STORE_SCHEMES = ("s3", "gs", "gcs")
# What a FUSE mount of a bucket is called in /proc/self/mountinfo: none of them keeps regen's
# guarantees (mountpoint-s3 has no rename and no append, s3fs-fuse renames by copying and keeps
# locks on the node, gcsfuse the same).
_BUCKET_MOUNTS = ("fuse.mountpoint-s3", "fuse.s3fs", "fuse.goofys", "fuse.gcsfuse", "fuse.rclone",
                  "fuse.juicefs", "fuse.s3ql", "fuse.geesefs")


def is_store_url(location: str | os.PathLike) -> bool:
    """An object-store URL (``s3://``, ``gs://``); ``file://`` and plain paths are local."""
    match = _URL.match(str(location))
    return bool(match) and match.group("scheme") in STORE_SCHEMES


def local_path(location: str | os.PathLike) -> Path:
    """A local location as a path: ``file:///x`` is ``/x``."""
    match = _URL.match(str(location))
    if match and match.group("scheme") == "file":
        return Path("/" + match.group("rest").lstrip("/"))
    if match:
        raise DataError(f"{location}: the scheme {match.group('scheme')}:// is not one regen reads or "
                        f"writes; use a path, file://, s3:// or gs://")
    return Path(location)


MOUNTINFO = "/proc/self/mountinfo"


def bucket_mount(path: str | os.PathLike) -> str | None:
    """The FUSE filesystem type of a bucket mount that holds ``path`` (None for any other)."""
    try:
        lines = Path(MOUNTINFO).read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for line in lines:
        fields = line.split(" - ", 1)
        if len(fields) != 2:
            continue
        mount_point = fields[0].split()[4].replace("\\040", " ")
        fstype = fields[1].split()[0]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, fstype
    return kind if kind in _BUCKET_MOUNTS or (kind or "").startswith("fuse.s3") else None


class ObjectStore:
    """A prefix of a filesystem fsspec knows, addressed by keys relative to it."""

    def __init__(self, url: str, fs, root: str):
        self.url, self.fs, self.root = url.rstrip("/"), fs, root.rstrip("/")

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def create(self, key: str, data: bytes) -> bool:
        """Write ``data`` at ``key`` unless something is there: True when this call created it."""
        try:
            self.fs.pipe_file(self.path(key), data, mode="create")
            return True
        except FileExistsError:
            return self._same(key, data)

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` whatever is there (a PUT replaces an object whole): documents
        about the data (the dataset card, a shard's published commit)."""
        self.fs.pipe_file(self.path(key), data)

    def replace_file(self, key: str, path: Path) -> None:
        """Upload the local file at ``path`` to ``key``, replacing what is there in one step (a
        reader gets the old object or the new one); multipart for a large file."""
        self.fs.put_file(str(path), self.path(key))

    def _same(self, key: str, data: bytes) -> bool:
        """A retry of a write that had landed finds its own bytes: that is a success."""
        try:
            there = self.read(key)
        except FileNotFoundError:
            return False
        return hashlib.sha256(there).digest() == hashlib.sha256(data).digest()

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self.path(key))

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def size(self, key: str) -> int:
        return int(self.fs.info(self.path(key))["size"])

    def names(self, prefix: str) -> list[str]:
        """The names directly under ``prefix`` (a folder of keys), sorted."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Name -> size of the keys directly under ``prefix``: one listing."""
        self.fs.invalidate_cache(self.path(prefix))
        try:
            entries = self.fs.ls(self.path(prefix), detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries}

    def read_many(self, keys: list[str]) -> list[bytes]:
        """Several objects at once (fsspec sends the requests concurrently)."""
        if not keys:
            return []
        found = self.fs.cat([self.path(k) for k in keys])
        return [found[self.path(k)] for k in keys]

    def remove(self, keys: list[str]) -> None:
        if keys:
            self.fs.rm([self.path(k) for k in keys])

    def arrow(self):
        """(pyarrow filesystem, root path) for readers that take one."""
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        return PyFileSystem(FSSpecHandler(self.fs)), self.root


class LocalStore(ObjectStore):
    """A local folder with the same contract: create-only by a hard link of a flushed file."""

    def __init__(self, root: str | os.PathLike):
        import fsspec

        root = str(Path(root).resolve())
        super().__init__(f"file://{root}", fsspec.filesystem("file"), root)

    def create(self, key: str, data: bytes) -> bool:
        final = Path(self.path(key))
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, final)
            except FileExistsError:
                return self._same(key, data)
            fsync_dir(final.parent)
            return True
        finally:
            os.unlink(tmp)

    def read(self, key: str) -> bytes:
        return Path(self.path(key)).read_bytes()

    def put(self, key: str, data: bytes) -> None:
        final = Path(self.path(key))
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(final) as tmp:
            tmp.write_bytes(data)

    def replace_file(self, key: str, path: Path) -> None:
        final = Path(self.path(key))
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(final) as tmp:
            shutil.copyfile(path, tmp)

    def sizes(self, prefix: str) -> dict[str, int]:
        folder = Path(self.path(prefix))
        if not folder.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in folder.iterdir() if not p.name.startswith(".")}

    def read_many(self, keys: list[str]) -> list[bytes]:
        return [self.read(k) for k in keys]

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            Path(self.path(key)).unlink(missing_ok=True)


def _filesystem(scheme: str):
    import fsspec

    if scheme == "s3":
        # botocore's standard retry mode backs off on 5xx, 429 and SlowDown, a few seconds in all;
        # a longer outage is regen's to wait out (store_outage_s), not s3fs's retries of botocore's.
        fs = fsspec.filesystem("s3", config_kwargs={"retries": {"mode": "standard", "max_attempts": 5}})
        fs.retries = 1
        return fs
    return fsspec.filesystem("gcs")


@functools.cache
def transient_errors() -> tuple[type[BaseException], ...]:
    """What a store's client raises when the store is unreachable or refuses for now (an OSError
    but a missing key or a refused permission, which its caller tells apart): worth trying again.
    A bug is not."""
    found: list[type[BaseException]] = [OSError]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError, ClientError

        found += [BotoCoreError, ClientError]
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError as HttpClientError

        found.append(HttpClientError)
    return tuple(found)


def _airflow_filesystem(url: str, conn_id: str):
    """The filesystem Airflow's ObjectStoragePath builds from the connection: its credentials stay
    in Airflow (a connection, a secrets backend), never in a Param or a log."""
    try:
        from airflow.sdk import ObjectStoragePath
    except ImportError:
        raise DataError(f"output_conn_id {conn_id}: an Airflow connection, and Airflow is not installed here; "
                        f"on an SSH node the node's own credentials apply: leave output_conn_id empty") from None
    return ObjectStoragePath(url, conn_id=conn_id).fs


def open_store(location: str | os.PathLike, conn_id: str | None = None) -> ObjectStore:
    """The store at ``location``: a bucket prefix for an object-store URL, else a local folder;
    opened with the Airflow connection ``conn_id`` when one is named."""
    if not is_store_url(location):
        return LocalStore(local_path(location))
    match = _URL.match(str(location))
    scheme = "gs" if match.group("scheme") == "gcs" else match.group("scheme")
    rest = match.group("rest").strip("/")
    if not rest:
        raise DataError(f"{location}: a bucket is missing (the form is {scheme}://BUCKET/PREFIX)")
    try:
        fs = _airflow_filesystem(f"{scheme}://{rest}", conn_id) if conn_id else _filesystem(scheme)
    except ImportError as exc:
        raise DataError(f"{location}: {scheme}:// needs {'s3fs' if scheme == 's3' else 'gcsfs'} "
                        f"installed on this node ({exc})") from None
    return ObjectStore(f"{scheme}://{rest}", fs, rest)


def published_files(store: ObjectStore) -> list[str]:
    """The data files of the dataset at ``store`` whose commit (regen.parts) exists and matches
    their size: what readers trust."""
    files = []
    for name in store.names(f"{META}/published"):
        commit = json.loads(store.read(f"{META}/published/{name}"))
        if store.size(commit["file"]) != commit["bytes"]:
            raise DataError(f"{store.url_of(commit['file'])}: {store.size(commit['file']):,} bytes where its "
                            f"commit says {commit['bytes']:,}: a rerun is replacing the shard (read again once it "
                            f"is published), one was killed while it did (the output's next run finishes it), or "
                            f"something else changed the file")
        files.append(commit["file"])
    return sorted(files)


def local_copy(url: str, folder: Path) -> Path:
    """A node-local copy of the object at ``url`` (a prompts file: its index addresses byte
    offsets), fetched again only when the object changed (its ETag or size)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
    except FileNotFoundError:
        raise DataError(f"{url}: no such object") from None
    except ImportError as exc:
        raise DataError(f"{url}: cannot read it on this node ({exc})") from None
    source = {"url": url, "size": info.get("size"),
              "version": info.get("ETag") or info.get("etag") or info.get("generation") or info.get("md5Hash")}
    copy = Path(folder) / f"{slug(url)}{Path(path).suffix}"
    marker = copy.with_name(copy.name + ".source.json")
    if copy.exists() and marker.exists() and json.loads(marker.read_text()) == source:
        return copy
    copy.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{copy.name}.", suffix=".tmp", dir=copy.parent)
    os.close(fd)
    try:
        fs.get_file(path, tmp)
        os.replace(tmp, copy)
    finally:
        Path(tmp).unlink(missing_ok=True)
    marker.write_text(json.dumps(source))
    return copy


def slug(url: str) -> str:
    """A folder name for a URL's node-local work: readable, and unique by its hash."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", url.split("://", 1)[-1]).strip("-")[-60:]
    return f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:10]}"

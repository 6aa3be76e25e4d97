"""Every path of an output directory, named once.

::

    OUTPUT/
      data/shard-IIIII-of-NNNNN.parquet   the dataset (a shard's file appears when it is complete)
      progress.json                       done / failed / total, throughput, ETA; atomic
      audit/                              report.html, summary.json, samples.parquet, samples_view.json
      work/                               what is in progress, never half-written into data/
        manifest.json, manifest.lock      the run manifest (prompts, model, settings)
        prompt-index.parquet, index.lock  per prompt: id, shard, hash, where it is in the file
        journal/shard-*.jsonl             rows of shards in progress
        locks/shard-*.lock                one generator per shard
        errors/shard-*.txt                unreadable prompt records, file:line
        skipped.jsonl                     conversations left out by skip_invalid, with the rule
        prompts/                          a local copy of prompts on an object store
        servers/                          servers.json, servers.lock, server-I.log, watchdog.*,
                                          leases/NAME.lease, slots/HOST-PORT/slot-NNNN
        nodes/NODE/                       the same, per node of a run over several nodes
        claims/NODE/slot-NNNN             the shards generating on each node now
        progress/                         each writer's part of progress.json, history.jsonl
        alerts/                           markers of alerts already sent

An object-store output (``s3://BUCKET/PREFIX``) keeps only ``data/`` and the part protocol's keys
in the bucket (:mod:`regen.parts`); everything else above is in a node-local folder under
``work_dir`` named after the URL (:func:`work_root`).

Who holds which lock and what happens when the holder dies: :mod:`regen.coordination`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from regen.errors import DataError
from regen.objectstore import (LocalStore, ObjectStore, is_store_url, local_path, open_store, published_files,
                               slug)

if TYPE_CHECKING:
    import pyarrow.parquet as pq

_SHARD_FILE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.parquet$")


def shard_name(shard: int, num_shards: int) -> str:
    """A shard's files: ``shard-00003-of-00016``."""
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def shard_key(shard: int) -> str:
    """A shard's part of progress.json and its lease: ``shard-00003``."""
    return f"shard-{shard:05d}"


def is_shard_key(name: str) -> bool:
    return re.fullmatch(r"shard-\d{5}", name) is not None


def parse_shard_file(name: str) -> tuple[int, int] | None:
    """(shard, num_shards) of a shard file's name; None for any other file."""
    match = _SHARD_FILE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class AuditFiles:
    """The audit's report directory (``OUTPUT/audit``, or the one ``--report`` names)."""

    root: Path

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def summary_json(self) -> Path:
        return self.root / "summary.json"

    @property
    def samples_parquet(self) -> Path:
        return self.root / "samples.parquet"

    @property
    def samples_view_json(self) -> Path:
        return self.root / "samples_view.json"


def work_root(url: str, work_dir: str | Path | None = None) -> Path:
    """The node-local folder of an object-store output's work in progress (and its audit)."""
    return Path(work_dir or Path.home() / ".cache" / "regen" / "work") / slug(url)


@dataclass(frozen=True)
class RunLayout:
    root: Path
    node: str | None = None  # a listed node of a run: its servers have their own folder
    # An object-store URL when the dataset lives there (regen.parts); root is then node-local work.
    dataset: str | None = None
    conn_id: str | None = None  # the Airflow connection the dataset's store is opened with

    def __init__(self, root: str | Path, node: str | None = None, dataset: str | None = None,
                 conn_id: str | None = None):
        if is_store_url(root):  # a folder named "s3:" in the working directory is never meant
            raise ValueError(f"{root}: an object-store URL is an output, not a folder: RunLayout.for_output")
        object.__setattr__(self, "root", Path(root))
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "dataset", dataset)
        object.__setattr__(self, "conn_id", conn_id)

    @classmethod
    def for_output(cls, output: str, node: str | None = None, work_dir: str | Path | None = None,
                   conn_id: str | None = None) -> "RunLayout":
        """An output folder, or an object-store URL whose work stays in ``work_dir``."""
        if is_store_url(output):
            return cls(work_root(output.rstrip("/"), work_dir), node, dataset=output.rstrip("/"), conn_id=conn_id)
        return cls(local_path(output), node)

    @classmethod
    def from_data_arg(cls, path: str | Path | RunLayout, work_dir: str | Path | None = None) -> "RunLayout":
        """``--data`` takes an output directory or its ``data/`` (a folder or a URL): either names the
        run (a layout already made is itself)."""
        if isinstance(path, RunLayout):
            return path
        if is_store_url(path):
            url = str(path).rstrip("/")
            return cls.for_output(url[:-len("/data")] if url.endswith("/data") else url, work_dir=work_dir)
        path = local_path(path)
        if path.name == "data":
            return cls(path.parent)
        if not (path / "data").is_dir() and any(path.glob("*.parquet")):  # read as <path>/data would be wrong
            raise DataError(f"{path}: Parquet files outside a data/ folder; --data takes an output folder "
                             f"or its data/ (move them into {path / 'data'})")
        return cls(path)

    # --- the dataset and what a person reads ---------------------------------------------
    @property
    def data(self) -> Path | str:
        return f"{self.dataset}/data" if self.dataset else self.root / "data"

    def store(self) -> ObjectStore:
        """Where the dataset's files are: the bucket's prefix, or the output folder."""
        return open_store(self.dataset, self.conn_id) if self.dataset else LocalStore(self.root)

    def asset_uri(self, ssh_conn_id: str | None = None) -> str:
        """The dataset's Airflow Asset: its data/ folder (on an SSH node, named by its connection)."""
        if self.dataset:
            return str(self.data)
        return f"file://{ssh_conn_id or ''}{self.data}"

    def shard_file(self, shard: int, num_shards: int) -> Path | PurePosixPath:
        if self.dataset:
            return PurePosixPath(self.store().path(f"data/{shard_name(shard, num_shards)}.parquet"))
        return self.data / f"{shard_name(shard, num_shards)}.parquet"

    def shard_files(self) -> list[Path]:
        if self.dataset:
            return [PurePosixPath(p) for p in self.data_files()]
        if not self.data.is_dir():
            return []
        return sorted(p for p in self.data.iterdir() if parse_shard_file(p.name))

    def data_files(self) -> list[Path] | list[str]:
        """Every Parquet file of the dataset (shard files, or files a user put there); on an object
        store the published ones only (regen.parts), as paths of :meth:`parquet`'s filesystem."""
        if self.dataset:
            store = self.store()
            return [store.path(key) for key in published_files(store)]
        if not self.data.is_dir():
            return []
        return sorted(p for p in self.data.glob("*.parquet") if not p.name.startswith((".", "_")))

    def parquet(self, path: Path | str) -> pq.ParquetFile:
        """One of :meth:`data_files`, opened where it is."""
        import pyarrow.parquet as pq  # not at import: the DAG file imports the config, which imports this

        if self.dataset:
            return pq.ParquetFile(path, filesystem=self.store().arrow()[0])
        return pq.ParquetFile(path)

    @property
    def progress_file(self) -> Path:
        return self.root / "progress.json"

    @property
    def audit(self) -> AuditFiles:
        return AuditFiles(self.root / "audit")

    # --- work in progress ----------------------------------------------------------------
    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def owner(self) -> Path:
        """The run that holds the output (regen.coordination.owner)."""
        return self.work / "owner.json"

    @property
    def owner_lock(self) -> Path:
        """Held while the claim is read and written: of two claims at once, one wins."""
        return self.work / "owner.lock"

    @property
    def manifest(self) -> Path:
        return self.work / "manifest.json"

    @property
    def manifest_lock(self) -> Path:
        return self.work / "manifest.lock"

    @property
    def template_probe_lock(self) -> Path:
        """Held while one process renders the served template's probe (regen.generate.reasoning_probed):
        shard processes started together render it once."""
        return self.work / "template-probe.lock"

    @property
    def prompt_index(self) -> Path:
        return self.work / "prompt-index.parquet"

    @property
    def index_lock(self) -> Path:
        return self.work / "index.lock"

    def journal(self, shard: int, num_shards: int) -> Path:
        return self.work / "journal" / f"{shard_name(shard, num_shards)}.jsonl"

    def shard_lock(self, shard: int, num_shards: int) -> Path:
        return self.work / "locks" / f"{shard_name(shard, num_shards)}.lock"

    @property
    def prompt_copies(self) -> Path:
        """Local copies of prompts files on an object store (regen.objectstore.local_copy)."""
        return self.work / "prompts"

    @property
    def skipped_prompts(self) -> Path:
        return self.work / "skipped.jsonl"

    def errors(self, shard: int, num_shards: int) -> Path:
        return self.work / "errors" / f"{shard_name(shard, num_shards)}.txt"

    @property
    def servers(self) -> Path:
        return self.work / "servers" if self.node is None else self.node_dir(self.node)

    def node_dir(self, node: str) -> Path:
        return self.work / "nodes" / node

    def node_claims(self, node: str) -> Path:
        """Slots of the shards generating on a node now."""
        return self.work / "claims" / node

    @property
    def servers_state(self) -> Path:
        return self.servers / "servers.json"

    @property
    def servers_lock(self) -> Path:
        return self.servers / "servers.lock"

    def server_log(self, index: int) -> Path:
        return self.servers / f"server-{index}.log"

    @property
    def leases(self) -> Path:
        return self.servers / "leases"

    def lease(self, name: str) -> Path:
        return self.leases / f"{name}.lease"

    @property
    def approval_hold(self) -> Path:
        """A canary's passing run waiting for a person's approval: the servers stay up."""
        return self.servers / "approval.json"

    def request_slots(self, url: str) -> Path:
        """The request slots of the server at ``url``."""
        return self.servers / "slots" / url.split("//", 1)[-1].replace(":", "-").replace("/", "_")

    @property
    def watchdog_log(self) -> Path:
        return self.servers / "watchdog.log"

    @property
    def progress_parts(self) -> Path:
        return self.work / "progress"

    def progress_part(self, name: str) -> Path:
        return self.progress_parts / f"{name}.json"

    @property
    def quality_lock(self) -> Path:
        """Held while the quality guard's marks are read and written (regen.quality)."""
        return self.progress_parts / "quality.lock"

    @property
    def history(self) -> Path:
        return self.progress_parts / "history.jsonl"

    @property
    def alerts(self) -> Path:
        return self.work / "alerts"

    def alert_marker(self, name: str) -> Path:
        """Present once the alert ``name`` has been sent (an alert that must go out once)."""
        return self.alerts / name

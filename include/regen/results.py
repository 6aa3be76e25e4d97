"""What each stage returns: one typed document per stage, the same whether the stage ran here or
on an SSH node (it crosses the wire as JSON and is read back into the same type). Every result
has a ``summary``: what the task log shows a person."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from regen.units import format_duration


class StageResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def summary_lines(self) -> list[str]:
        summary = getattr(self, "summary", None)
        return summary if isinstance(summary, list) else [summary] if summary else []


class PreflightResult(StageResult):
    shards: list[int]  # the shards with work left: what the DAG maps generate over
    up_to_date: bool
    info: dict[str, Any]
    seconds: float
    summary: str


class StagedModel(StageResult):
    path: str  # what the servers load: the staged copy, or the source when staging is off
    copied: bool
    bytes: int
    seconds: float
    fingerprint: str | None
    summary: str


class ServersUp(StageResult):
    urls: list[str]
    servers: list[dict[str, Any]]
    summary: str


class PlannedServer(BaseModel):
    index: int
    port: int
    cuda_visible_devices: str | None  # its tp_size x dp_size GPUs; None: a CPU server
    argv: list[str]


class ServerPlan(StageResult):
    """What start_servers would launch (``regen serve --dry-run``, preflight's report)."""
    servers: list[PlannedServer]
    # Each server's operating point on its GPU (regen.servers.capacity): None where no GPU is known.
    operating_point: dict[str, Any] | None = None


class ServersStopped(StageResult):
    stopped: int
    left: list[dict[str, Any]]  # other runs' servers, left running
    summary: str


class ServerLogs(StageResult):
    servers: int
    logs: str
    summary: str


class CanaryReport(StageResult):
    passed: bool
    samples: int
    estimate: dict[str, Any]
    examples: list[dict[str, Any]]
    summary: str

    @classmethod
    def merged(cls, reports: list["CanaryReport"]) -> "CanaryReport":
        """One report for a run's nodes, each of which ran its own canary."""
        if len(reports) == 1:
            return reports[0]
        return cls(passed=all(r.passed for r in reports), samples=sum(r.samples for r in reports),
                   estimate={"text": "; ".join(r.estimate.get("text", "n/a") for r in reports)},
                   examples=[e for r in reports for e in r.examples],
                   summary="; ".join(r.summary for r in reports))


class ShardResult(StageResult):
    shard: int
    num_shards: int
    total: int
    done: int
    failed: int
    skipped: int
    bad_records: int
    seconds: float
    tokens: int
    path: str | None
    node: str | None = None  # the node it generated on, when the run lists nodes
    summary: str = ""

    def model_post_init(self, _context: Any) -> None:
        if not self.summary:
            rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
            self.summary = (f"shard {self.shard}/{self.num_shards}: {self.done + self.skipped:,}/{self.total:,} "
                            f"rows ({self.skipped:,} from earlier runs), {self.failed:,} failed, "
                            f"{self.bad_records:,} unreadable records, {rate:,.0f} tok/s, "
                            f"{format_duration(self.seconds)}")


class GenerateResult(StageResult):
    """The shards of one generate attempt (one for a DAG task), and their totals."""

    shards: list[ShardResult]
    seconds: float
    summary: list[str] = []

    def model_post_init(self, _context: Any) -> None:
        if not self.summary:
            self.summary = [s.summary for s in self.shards]
            if len(self.shards) > 1:
                rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
                self.summary.append(f"{len(self.shards)} shards: {self.done + self.skipped:,}/{self.total:,} rows "
                                    f"({self.skipped:,} from earlier runs), {self.failed:,} failed, {rate:,.0f} tok/s, "
                                    f"{format_duration(self.seconds)}")

    def _sum(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.shards)

    total = property(lambda self: self._sum("total"))
    done = property(lambda self: self._sum("done"))
    failed = property(lambda self: self._sum("failed"))
    skipped = property(lambda self: self._sum("skipped"))
    bad_records = property(lambda self: self._sum("bad_records"))
    tokens = property(lambda self: self._sum("tokens"))

    @property
    def path(self) -> str | None:
        """The shard's file, for an attempt at one shard."""
        return self.shards[0].path if len(self.shards) == 1 else None


class AuditResult(StageResult):
    verdict: str
    reasons: list[str] = []  # why a FAIL fails, one line per broken bound
    rows: int  # the dataset's rows; samples are what training sees (one per assistant turn in events)
    samples: int
    audited: int
    degenerate_fraction: float
    divergence_fraction: float = 0.0  # of the agentic rows, those a divergence ended early
    thresholds: dict[str, Any]
    train_view: dict[str, Any]
    counts: dict[str, int]
    fractions: dict[str, float]
    loss_tokens: dict[str, Any]
    completion_tokens: dict[str, Any]
    thinking_rows: int
    reasoning_rows: int
    agentic: dict[str, Any]  # agentic rows: steps, spliced results, changed arguments, divergences by kind
    on_policy: dict[str, Any]  # samples with the engine's token ids: checked, exact, the others by reason, fraction
    example_degenerate: dict[str, Any] | None
    provenance: dict[str, Any]
    summary: list[str]
    output: str | None = None  # the output directory audited
    dataset_uri: str | None = None  # its data/ as an Airflow Asset URI (on an SSH node, named by it)


class RunStatus(StageResult):
    output: str
    progress: dict[str, Any]
    history: list[dict[str, Any]]
    audit: dict[str, Any] | None
    nodes: list[dict[str, Any]]
    summary: str
    attention: list[dict[str, Any]] = []  # regen.status.attention: what went wrong, what to do

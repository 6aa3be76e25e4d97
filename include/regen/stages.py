"""The registry of stages: what a task or a command can run, where it runs, and what it returns.

A stage is a function of a RunConfig named as the stage (``start_servers`` is
``regen.servers.lifecycle.start_servers``), in the module named here, imported only when it runs: preflight must be able to report a broken module (a SyntaxError
such as the seed's) without importing it first. The same registry is what preflight's import
check imports in a fresh interpreter (:func:`entry_modules`) and what a node runs by name
(``regen run-stage NAME``): nothing else runs by name.

Where a stage runs (:class:`Where`) is decided by :mod:`regen.pipeline`, never by its caller.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Callable

from regen import results

# How a shard's log says its deadline moved with its pace (regen.generate.ShardRun._keep_pace),
# followed by the new deadline in seconds from its start: an SSH follower waits that much longer.
DEADLINE_MOVED = "deadline moved to"


class Where(enum.Enum):
    RUN = "where the run's config says (here, or its SSH node)"
    NODE = "on one node of the run (its SSH connection, or here: the task is on its queue)"
    CLAIM = "on the node the shard claims: the one with free room among those that answer"
    EVERY_NODE = "on every node of the run, one after the other; one merged result"
    AFTER_GENERATION = "where the run's config says, once the run's own servers are stopped"


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # where the function named as the stage lives
    result: type[results.StageResult]
    where: Where
    takes_run_id: bool = False
    # How long the stage may take (a task's execution_timeout, a remote command's deadline): long
    # enough for honest work, so that only a hung node or command meets it. The servers' own
    # startup timeout is added for the stage that starts them; a shard's deadline comes from the
    # canary's estimate (regen.generate.shard_deadline_s) when there is one, and moves with its
    # pace: Airflow's execution_timeout for it is the stage's own, a backstop.
    deadline_s: float = 3600.0
    plus_startup_timeout: bool = False
    # It works on the run's output: in a DAG run it holds the output's claim while it runs
    # (regen.coordination.owner.holding_output), and fails at once if another run took it over.
    holds_output: bool = False

    def deadline(self, startup_timeout_s: float, kwargs: dict | None = None) -> float:
        """This stage's deadline with these servers (their startup timeout) and arguments."""
        given = (kwargs or {}).get("deadline_s")
        if given:
            return float(given)
        return self.deadline_s + (startup_timeout_s if self.plus_startup_timeout else 0.0)

    def function(self) -> Callable[..., results.StageResult]:
        return getattr(importlib.import_module(self.module), self.name)


STAGES: dict[str, Stage] = {stage.name: stage for stage in (
    Stage("preflight", "regen.preflight", results.PreflightResult, Where.RUN, takes_run_id=True),
    Stage("stage_weights", "regen.preflight", results.StagedModel, Where.NODE,
          deadline_s=6 * 3600.0, holds_output=True),  # a terabyte of weights from a slow share
    Stage("start_servers", "regen.servers.lifecycle", results.ServersUp, Where.NODE, takes_run_id=True,
          deadline_s=900.0, plus_startup_timeout=True, holds_output=True),
    Stage("canary", "regen.canary", results.CanaryReport, Where.EVERY_NODE, takes_run_id=True,
          deadline_s=2 * 3600.0, holds_output=True),
    Stage("generate", "regen.generate", results.GenerateResult, Where.CLAIM, takes_run_id=True,
          deadline_s=7 * 24 * 3600.0, holds_output=True),  # without a canary's estimate: a week
    Stage("stop_servers", "regen.servers.lifecycle", results.ServersStopped, Where.NODE,
          takes_run_id=True, deadline_s=900.0),
    Stage("audit", "regen.audit.dataset", results.AuditResult, Where.AFTER_GENERATION,
          deadline_s=6 * 3600.0, holds_output=True),
    Stage("server_plan", "regen.servers.plan", results.ServerPlan, Where.NODE, deadline_s=300.0),
    Stage("server_logs", "regen.servers.lifecycle", results.ServerLogs, Where.NODE, deadline_s=300.0),
    Stage("status", "regen.status", results.RunStatus, Where.RUN, deadline_s=60.0),
)}

# Programs regen starts as processes of their own (beside the stages, which import the rest).
PROGRAMS = ("regen.cli", "regen.remote", "regen.servers.watchdog", "regen.logrelay",
            "regen.engines.simulator.app")


def stage(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"{name!r} is not a stage (known: {', '.join(STAGES)})")
    return STAGES[name]


def entry_modules() -> list[str]:
    """Every module a run imports first: importing these proves the code that will run loads."""
    return list(dict.fromkeys([*(s.module for s in STAGES.values()), *PROGRAMS]))

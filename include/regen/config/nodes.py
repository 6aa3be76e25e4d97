"""The nodes of a run. A run always has a list of them: the ones its config lists, or the one
node its top-level fields describe (named after the machine that runs it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from regen.config.options import HOST
from regen.machine import node_name

# The run's own fields a listed node may set differently (by their flat names).
NODE_OVERRIDES = ("ssh_conn_id", "remote_regen", "gpus", "num_servers", "host", "base_port", "staging_dir",
                  "engine_python", "extra_server_args", "max_running_requests", "tp_size", "dp_size",
                  "sim_tokens_per_second")


class NodeSpec(BaseModel):
    """One GPU node of a run: how it is reached and what differs on it. A field left empty
    takes the run's value."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,39}$", description="Names its tasks and its servers' folder.")
    queue: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-.]{1,100}$",
                              description="Celery queue of the worker on this node.")
    ssh_conn_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-.]{1,250}$",
                                    description="Airflow SSH connection of this node.")
    remote_regen: str | None = None
    gpus: list[int] | None = None
    num_servers: int | None = Field(None, ge=1, le=64)
    host: str | None = Field(None, pattern=HOST.pattern,
                             description="Address its servers listen on and are reached at.")
    base_port: int | None = Field(None, ge=1024, le=65000)
    staging_dir: str | None = None
    engine_python: str | None = None
    extra_server_args: list[str] | None = None
    max_running_requests: int | None = Field(None, ge=1)
    tp_size: int | None = Field(None, ge=1, le=64)
    dp_size: int | None = Field(None, ge=1, le=64)
    sim_tokens_per_second: float | None = Field(None, ge=0)
    max_shards: int = Field(2, ge=1, le=1024, description="Shards generating on this node at once.")
    # The one node of a run that lists none: its stages run where the run's tasks run, under
    # the tasks' plain names, and its shards may bring its servers up themselves.
    _own: bool = PrivateAttr(False)

    @classmethod
    def of_run(cls, max_shards: int) -> "NodeSpec":
        """The node of a run that lists none: this machine."""
        spec = cls.model_construct(name=node_name(), max_shards=max_shards)
        spec._own = True
        return spec

    @property
    def is_run_node(self) -> bool:
        """The run's own node (not listed in ``nodes``)."""
        return self._own

    def task_id(self, task: str) -> str:
        """The id of this node's ``task`` in the DAG: the plain name for the run's own node."""
        return task if self._own else f"{task}_{self.name}"

    def overrides(self) -> dict[str, Any]:
        """The run's fields this node sets."""
        return {k: v for k, v in self.model_dump(include=set(NODE_OVERRIDES)).items() if v is not None}

    def reached_by(self, ssh_conn_id: str | None) -> str:
        return (f"ssh {ssh_conn_id}" if ssh_conn_id else f"queue {self.queue}" if self.queue
                else "this machine")

"""Where work runs: which node a shard generates on, which servers a stage uses, and bringing the
run's own servers back up when a shard or the canary finds none.

A shard claims a node when it starts: one of ``max_shards`` slots of that node
(:func:`regen.coordination.shard_claims`), held for as long as the shard runs, so the kernel
hands the slot back however the shard ends. It takes the node with the most free slots among
those whose servers answer, so a node that finishes its shards sooner takes more of them: with
many more shards than nodes, the work splits by each node's real speed without anyone measuring
it. A node that is lost stops answering; its shards fail, Airflow retries them, and each retry
claims a node that answers and resumes from the shard's journal: the output directory is shared
by every node (an NFS or Lustre mount on a GPU cluster), so journals, shard files and claims are
wherever the shard lands.

The run's own node (a run that lists none) is the one exception to "never start servers from a
shard": its shards and canary run where its servers run, and bring them up again when a retry
or a clear comes after the teardown.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Iterator

from regen.config import NodeSpec, RunConfig
from regen.coordination import shard_claims
from regen.errors import RegenError
from regen.machine import node_name
from regen.manifest import Manifest
from regen.servers import lifecycle
from regen.servers.probe import is_healthy
from regen.servers.records import ServerRecord, read_state
from regen.weights import staged_model

log = logging.getLogger("regen.placement")

CLAIM_POLL_S = 1.0
# A shard whose listed node stops answering gives up after this long, so that its retry can
# claim another node (on the run's own node it waits longer: there is nowhere else to go).
NODE_LOST_AFTER_S = 15.0


class NoNodeAnswers(RegenError):
    """No node of the run has a server that answers: nothing to generate on."""


def node_answers(node_cfg: RunConfig) -> bool:
    """At least one of the node's recorded servers answers /health."""
    return any(is_healthy(r.url, timeout=3.0) for r in read_state(node_cfg.layout, node_cfg.servers.api_key) if r.url)


def can_take_shards(cfg: RunConfig, spec: NodeSpec) -> bool:
    """The run's own node always can (its shards bring its servers up); a listed node when its
    servers answer."""
    return spec.is_run_node or node_answers(cfg.for_node(spec))


@contextlib.contextmanager
def claim_node(cfg: RunConfig, shards: list[int], give_up_after_s: float = 600.0) -> Iterator[NodeSpec]:
    """The node these shards generate on, held until the block ends: one of the run's nodes, or
    the one the config names (``regen generate --node NAME``). Waits while every answering node
    is full; NoNodeAnswers when none answers for ``give_up_after_s``."""
    specs = [cfg.this_node()] if cfg.node else cfg.node_specs()
    label = f"shard {shards[0]} generates" if len(shards) == 1 else f"shards {', '.join(map(str, shards))} generate"
    claims = {spec.name: shard_claims(cfg.layout, spec.name, spec.max_shards) for spec in specs}
    silent_since = time.monotonic()
    while True:
        answering = [spec for spec in specs if can_take_shards(cfg, spec)]
        if answering:
            silent_since = time.monotonic()
        elif time.monotonic() - silent_since > give_up_after_s:
            raise NoNodeAnswers(f"no node of this run answers ({', '.join(s.name for s in specs)}) for "
                                f"{give_up_after_s:.0f} s: restart their servers (clear start_servers_NODE) "
                                f"and retry the shard; finished rows are kept")
        by_room = sorted(answering, key=lambda s: -claims[s.name].free() / claims[s.name].size)
        for spec in by_room:
            claim = claims[spec.name]
            if not claim.take(1):
                continue
            log.info("%s on node %s (%d of its %d shard slots taken)", label, spec.name,
                     claim.size - claim.free(), claim.size)
            try:
                yield spec
            finally:
                claim.close()
            return
        time.sleep(CLAIM_POLL_S)


def servers_for(cfg: RunConfig, run_id: str | None) -> list[ServerRecord]:
    """The servers a shard or the canary uses. A listed node's: the ones its start_servers task
    recorded, reached over the network from wherever this runs (never started here: this may be
    another machine). The run's own node's: with ``run_id`` (a DAG task) brought up here if they
    are gone, else as recorded."""
    if not cfg.this_node().is_run_node:
        records = read_state(cfg.layout, cfg.servers.api_key)
        if not records:
            raise lifecycle.ServerError(f"node {cfg.node} has no servers recorded in {cfg.layout.servers}: "
                                        f"clear {cfg.this_node().task_id('start_servers')}")
        return records
    return bring_up(cfg, run_id) if run_id else lifecycle.recorded(cfg)


def bring_up(cfg: RunConfig, run_id: str) -> list[ServerRecord]:
    """The run's own servers, started here if none runs (a shard or canary retried after the
    teardown ran): the same staging and start as the setup tasks, under the node's lock."""
    layout = cfg.layout
    with lifecycle.node_lock(layout):  # another shard may be starting them: its start ends with them healthy
        records = lifecycle.refuse_other_nodes(read_state(layout))
    if records and any(r.running() for r in records):
        return lifecycle.recorded(cfg)
    log.warning("no server of this output is running on %s: starting them here (run %s)",
                node_name(), run_id)
    model = Manifest(layout).read().get("model") or {}
    path, fingerprint = model.get("path"), model.get("fingerprint")
    if not path or not Path(path).is_dir():
        staged = staged_model(cfg)
        path, fingerprint = staged.path, staged.fingerprint
    return lifecycle.launch_servers(cfg, path, run_id, fingerprint)

"""Preflight: every check that needs no GPU, all of them, before any GPU time is spent.

Each check adds problems instead of raising, so a failed preflight lists everything wrong at once,
one line each. One module per subject: the code (code.py), the prompts and the model
(inputs.py), the tokenizer and chat template (template.py), the node's engine, disk, GPUs and
ports (node.py); this module runs them as the preflight and stage_weights stages.
"""

from __future__ import annotations

import logging
import time

from regen.config import RunConfig
from regen.preflight.code import check_code
from regen.preflight.inputs import check_model, check_prompts
from regen.preflight.node import (check_engine, check_map_length, check_nodes, check_output, check_ports,
                                  check_space, check_store)
from regen.preflight.report import PreflightFailed, PreflightReport
from regen.preflight.template import trainer_cut_line
from regen.results import PreflightResult, StagedModel

log = logging.getLogger("regen.preflight")


def run_preflight(cfg: RunConfig, code: bool = True, max_map_length: int | None = None,
                  scope: str = "all", dag_nodes: list[str] | None = None,
                  dag_queue: str | None = None) -> PreflightReport:
    """``scope``: "all" (a one-node run), "run" (what every node shares: config, prompts,
    output) or "node" (what each node has: code, engine, model, staging space, ports). A shard
    count left empty is the fleet's, as :func:`check` records it."""
    from regen.servers.gpus import fleet_size

    started = time.monotonic()
    cfg = cfg.with_num_shards(fleet_size(cfg))
    report = PreflightReport()
    if code:
        report.problems.extend(check_code())
    if scope != "node":
        check_map_length(cfg, report, max_map_length)
        check_nodes(cfg, report, dag_nodes, dag_queue)
    if scope != "run":
        check_engine(cfg, report)
    if scope != "node":
        check_prompts(cfg, report)
    check_model(cfg, report)
    check_store(cfg, report)
    check_space(cfg, report)
    if scope != "node":
        check_output(cfg, report)
    if scope != "run":
        check_ports(cfg, report)
    report.seconds = time.monotonic() - started
    return report


def stage_weights(cfg: RunConfig) -> StagedModel:
    """The stage_weights stage of one node: a listed node's own checks first, on that node's
    interpreter (its code, engine, model, staging space and ports; the run's own node had them
    in preflight), then its weights staged."""
    from regen.weights import staged_model

    if not cfg.this_node().is_run_node:
        report = run_preflight(cfg, scope="node")
        if not report.ok:
            raise PreflightFailed([f"node {cfg.node}: {problem}" for problem in report.problems])
        log.info("node %s: preflight passed in %.1f s (engine %s; %s)", cfg.node, report.seconds, cfg.engine,
                 plan_line(report.info.get("servers", [])))
    return staged_model(cfg)


def live_runs(cfg: RunConfig) -> set[str]:
    """The runs that show life on the output, on every node: a live lease, a pending approval,
    a running server of this machine's."""
    from regen.coordination import approval_pending, live_leases
    from regen.files import read_json
    from regen.servers.records import read_state

    runs: set[str] = set()
    for spec in cfg.node_specs():
        layout = cfg.for_node(spec).layout
        runs |= {lease.get("run_id", "") for lease in live_leases(layout)}
        if approval_pending(layout):
            runs.add((read_json(layout.approval_hold) or {}).get("run_id", ""))
        runs |= {r.owner for r in read_state(layout) if r.is_here() and r.running()}
    return runs


def preflight(cfg: RunConfig, code: bool = True, run_id: str = "cli",
          max_map_length: int | None = None, dag_nodes: list[str] | None = None,
          dag_queue: str | None = None, ended_runs: list[str] | None = None) -> PreflightResult:
    """The preflight stage: every check, here, with this interpreter; PreflightFailed listing
    every problem, else the run manifest written (the prompt index) and the shards to map over.
    ``max_map_length``: the deployment's limit on mapped tasks (the DAG passes Airflow's);
    ``dag_nodes`` and ``dag_queue``: the listed node names and the run's queue the DAG was built with;
    ``ended_runs``: with a DAG, the runs Airflow says have ended (only those are taken over; None:
    no one to ask, a holder with no sign of life for 30 min is)."""
    from regen.manifest import Manifest
    from regen.servers.gpus import fleet_size

    cfg = cfg.with_num_shards(fleet_size(cfg))  # recorded with the prompt index below
    report = run_preflight(cfg, code=code, max_map_length=max_map_length,
                           scope="run" if cfg.nodes else "all", dag_nodes=dag_nodes, dag_queue=dag_queue)
    if not report.ok:
        raise PreflightFailed(report.problems)
    if run_id != "cli":  # a DAG run; the operator's own CLI claims nothing
        from regen.coordination import OutputHeld, claim_output

        try:
            claim_output(cfg.layout, run_id, live_runs(cfg), ended_runs)
        except OutputHeld as exc:
            raise PreflightFailed([str(exc)], held_by=exc.holder) from None
    from regen.generate import shards_to_run  # only now: the code it is in has just been checked
    manifest = Manifest(cfg.layout)
    manifest.write_prompts(cfg, report.info["_index"], run_id)
    if "history_reasoning" in report.info:  # what the shards send back (regen.generate.reasoning_sent)
        manifest.update(history_reasoning=report.info["history_reasoning"])
    info = {k: v for k, v in report.info.items() if not k.startswith("_")}
    shards = shards_to_run(cfg)
    unaudited = not shards and run_id != "cli" and bool(manifest.read().get("audit_due"))
    if shards:  # until an audit of the whole output passes
        manifest.update(audit_due=True)
    elif unaudited:  # a run stopped before its audit, or its audit failed: this one audits (nothing to send)
        shards = list(range(cfg.num_shards))
    elif run_id != "cli":  # up to date: no task of this run will use the output
        from regen.coordination import release_output

        release_output(cfg.layout, run_id)
    work = ("up to date, but not yet passed by an audit (a run stopped before its audit, or the audit failed): "
            "this run sends nothing and audits it"
            if unaudited else f"{len(shards)} of {cfg.num_shards} shards with work" if shards else
            "up to date: every prompt has a good row of this model and settings, nothing to send")
    return PreflightResult(shards=shards, up_to_date=not shards, info=info, seconds=round(report.seconds, 2),
                           summary=f"preflight passed in {report.seconds:.1f} s: "
                                   f"{info.get('prompts', 0):,} prompts"
                                   + (f" ({sum(info['skipped_conversations'].values()):,} skipped)"
                                      if info.get("skipped_conversations") else "")
                                   + (f", {info['agentic_prompts']:,} of them agentic"
                                      if info.get("agentic_prompts") else "")
                                   + f", engine {cfg.engine}, training as {info.get('train_template')} "
                                   f"({info.get('train_layout')} layout{limits_text(info.get('train_limits'))}); {work}"
                                   + (f"\n{plan_line(info['servers'])}" if "servers" in info else "")
                                   + (f"\nlaunch command checked by {info['launch_checked_by']}"
                                      if cfg.engine != "sim" and "launch_checked_by" in info else "")
                                   + "".join(f"\nnot checked here: {what}" for what in info.get("not_checked", []))
                                   + (f"\n{line}" if (line := trainer_cut_line(info.get("trainer_cut") or {})) else ""))


def limits_text(limits: dict | None) -> str:
    """The audit's limits as resolved for the training template (its recipe where the config left them empty)."""
    if not limits:
        return ""
    cut = f"max length {limits['max_length']:,}" if limits["max_length"] else "no cut"
    return (f", {cut}, min loss tokens {limits['min_loss_tokens']}, "
            f"on-policy at least {limits['min_on_policy_fraction']:.0%}")


def plan_line(servers: list[dict]) -> str:
    """The server plan in one line: each server's port and GPUs (the argv is in the result)."""
    return f"{len(servers)} server(s): " + "; ".join(
        f":{s['port']} on " + (f"GPU {s['cuda_visible_devices']}" if s["cuda_visible_devices"] else "CPU")
        for s in servers)

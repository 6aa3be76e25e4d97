"""
### regenerate_dataset

Regenerates a training dataset with the *target* model, thinking traces on, over one inference
server per GPU. One run = one regeneration:

`preflight` → `stage_weights` → `start_servers` (setup) → `canary` → (`approve`, when the run asks
for a person's approval) → `generate` × shards → `audit`,
with `stop_servers` (teardown) as soon as generation ends, whether the shards succeeded or not,
so no GPU idles through the audit. A run over several GPU nodes (`nodes`) has each node's
`preflight_NODE` → `stage_weights_NODE` → `start_servers_NODE` … `stop_servers_NODE` on its
queue, all nodes at once; each shard claims the node with free capacity when it starts.

Nothing that costs GPU time starts before `preflight` has compiled the code, validated the config,
the prompts and the chat template. Clearing a failed shard resumes it where it stopped.
Outputs: `OUTPUT/data/*.parquet`, `OUTPUT/progress.json`, `OUTPUT/audit/report.html`.

The DAG only wires tasks; each task runs one stage function of the `regen` package
(`include/regen`), named in the task, through `regen.pipeline.run` (here, or on the SSH node).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import Asset, AssetAlias, AssetAny, Param, dag, get_current_context, task

from regen import deployment
from regen.alerts import notifier
from regen.config import param_schemas

# Every finished dataset is announced under one alias: a training DAG schedules on
# AssetAlias("regen_dataset"); each event names the dataset's own Asset (its data/ folder) and
# carries its row count and audit verdict. A DAG from a deployment's config file also announces
# its own Asset, named `regenerate_NAME` (URI `regen://regenerate_NAME`), with the same extra.
DATASET = AssetAlias("regen_dataset")
QUEUE = deployment.queue()
SHARD_POOL = deployment.shard_pool()
SHARD_RETRIES, SHARD_RETRY_DELAY_S = deployment.shard_retries()


def _config(params):
    from regen.config import RunConfig

    return RunConfig.from_mapping(dict(params), source="params")


def _run(stage, params, node: str | None = None, **kwargs) -> dict:
    """Run one stage (a function of the regen package) here or on the run's SSH node; ``node``:
    for that node of a run over several."""
    from regen.pipeline import run

    cfg = _config(params)
    return run(stage, cfg.for_node(node) if node else cfg, **kwargs)


def _nodes(params) -> list[str | None]:
    """The nodes the per-node stages run for: each of ``nodes``, or the one node (None)."""
    return [spec.name for spec in _config(params).nodes] or [None]


def _run_id() -> str:
    """Who owns what a run starts (its servers): this DAG run, whoever clears or retries it."""
    context = get_current_context()
    return f"{context['dag'].dag_id}/{context['run_id']}"


@task(retries=0)
def preflight(dag_nodes: list[str], params=None) -> list[int]:
    from airflow.configuration import conf

    from regen.preflight import preflight

    return _run(preflight, params, run_id=_run_id(), dag_nodes=dag_nodes,
                max_map_length=conf.getint("core", "max_map_length"))["shards"]


@task(retries=0)
def node_preflight(shards: list[int], node: str, params=None) -> list[int]:
    from regen.preflight import node_preflight

    _run(node_preflight, params, node=node)
    return shards


@task(retries=1, retry_delay=timedelta(seconds=10))
def stage_weights(shards: list[int], node: str | None = None, params=None) -> str:
    from airflow.exceptions import AirflowSkipException

    from regen.stage import stage_weights

    if not shards:  # a scheduled run with nothing new: no weights, no servers, no requests
        raise AirflowSkipException("the dataset is up to date (see preflight); nothing to regenerate")
    return _run(stage_weights, params, node=node)["path"]


@task(retries=0)
def start_servers(served_model_path: str, node: str | None = None, params=None) -> list[str]:
    from regen.servers import serve

    return _run(serve, params, node=node, served_model_path=served_model_path, run_id=_run_id())["urls"]


@task(retries=0)
def canary(params=None) -> dict:
    """The canary on every node: a misconfigured node fails the run before the shards start."""
    from regen.canary import canary

    results = [_run(canary, params, node=node, run_id=_run_id()) for node in _nodes(params)]
    return {"estimate": {"text": "; ".join(r["estimate"]["text"] for r in results)},
            "examples": [e for r in results for e in r["examples"]]}


@task.branch(retries=0)
def approval_gate(params=None) -> str:
    """Straight to the shards, or through a person's approval when the run asks for one."""
    return "approve" if params["approve_after_canary"] else "generate"


APPROVAL_BODY = """The canary of **{{ dag_run.dag_id }}** passed: {{ ti.xcom_pull(task_ids='canary')['estimate']['text'] }}.

{% for e in ti.xcom_pull(task_ids='canary')['examples'] %}
**{{ e.id }}** ({{ e.turns }} turn(s))

> reasoning: {{ e.reasoning_content | replace('\n', ' ') | truncate(400) }}
>
> answer: {{ e.content | replace('\n', ' ') | truncate(400) }}
{% endfor %}
Approve to start the shards; reject to stop the run here (its servers are stopped)."""


@task(retries=SHARD_RETRIES, retry_delay=timedelta(seconds=SHARD_RETRY_DELAY_S), map_index_template="{{ shard_label }}",
      pool=SHARD_POOL, trigger_rule="none_failed_min_one_success")  # straight from the gate, or approved
def generate(shard: int, params=None) -> str:
    from regen.nodes import generate_shard

    get_current_context()["shard_label"] = f"shard {shard}/{params['num_shards']}"
    return generate_shard(_config(params), shard, _run_id())["summary"]


@task(retries=0)
def audit(params=None) -> dict:
    from regen.audit import audit
    from regen.servers import stop

    cfg = _config(params)
    # Generation is over: this run's servers go, also when a shard brought them up itself after
    # the teardown had run (a run cleared with "only failed" does not run the teardown again).
    # Over several nodes shards never start servers, and each node's teardown runs on that node.
    if not cfg.nodes:
        _run(stop, params, run_id=_run_id())
    summary = _run(audit, params)
    extra = {"rows": summary["samples"], "verdict": summary["verdict"],
             "degenerate_fraction": summary["degenerate_fraction"], "output": cfg.output}
    events = get_current_context()["outlet_events"]
    events[DATASET].add(Asset(f"file://{cfg.ssh_conn_id or ''}{cfg.output}/data"), extra=extra)
    for outlet in get_current_context()["task"].outlets:
        if isinstance(outlet, Asset):
            events[outlet].extra = extra
    return summary


@task(retries=1, retry_delay=timedelta(seconds=5))
def stop_servers(node: str | None = None, params=None) -> int:
    from regen.servers import stop

    return _run(stop, params, node=node, run_id=_run_id())["stopped"]


def regeneration_dag(run: deployment.RunDefinition):
    """One regeneration DAG: the same tasks whatever the deployment; its own defaults,
    schedule and dataset."""
    schedule = AssetAny(*(Asset(uri) for uri in run.schedule)) if isinstance(run.schedule, list) else run.schedule
    outlets = [DATASET] + ([Asset(name=run.dataset_name, uri=f"regen://{run.dataset_name}")]
                           if run.dataset_name else [])

    @dag(
        dag_id=run.dag_id,
        schedule=schedule,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        params={name: Param(default, **schema) for name, (default, schema) in param_schemas(run.config).items()},
        doc_md=__doc__ + (f"\n\nDefaults and schedule from `{run.source}`." if run.source else ""),
        tags=["regen", "llm-data"],
        default_args={"on_failure_callback": [notifier()], "queue": QUEUE},
    )
    def regenerate():
        shards = preflight([spec.name for spec in run.config.nodes])
        generated = generate.expand(shard=shards)
        checked = canary()
        if not run.config.nodes:  # one node: its tasks under their plain names
            servers = start_servers(stage_weights(shards))
            servers >> checked
            generated >> stop_servers().as_teardown(setups=servers)
        for spec in run.config.nodes:  # several: each node's own, on its own queue, all at once
            on_node = {"queue": spec.queue or QUEUE}
            ready = node_preflight.override(task_id=f"preflight_{spec.name}", **on_node)(shards, spec.name)
            model = stage_weights.override(task_id=f"stage_weights_{spec.name}", **on_node)(ready, spec.name)
            servers = start_servers.override(task_id=f"start_servers_{spec.name}", **on_node)(model, spec.name)
            servers >> checked
            generated >> stop_servers.override(task_id=f"stop_servers_{spec.name}", **on_node)(
                spec.name).as_teardown(setups=servers)
        gate = approval_gate()
        approve = ApprovalOperator(task_id="approve", subject="regen: start generating {{ dag_run.dag_id }}?",
                                   body=APPROVAL_BODY, retries=0)
        checked >> gate >> [approve, generated]
        approve >> generated >> audit.override(outlets=outlets)()

    return regenerate()


# Broken config files are reported by regen_config_errors.py, so that they never hide these.
for _run_definition in deployment.run_definitions()[0]:
    globals()[_run_definition.dag_id] = regeneration_dag(_run_definition)

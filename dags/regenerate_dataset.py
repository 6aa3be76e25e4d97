"""
### How a regen DAG works

Regenerates a training dataset with the *target* model, thinking traces on, over one inference
server per GPU. One run = one regeneration:

`preflight` → `stage_weights` → `start_servers` (setup) → `canary` → (`approve`, when the run asks
for a person's approval) → `generate` × shards → `audit`,
with `stop_servers` (teardown) as soon as generation ends, whether the shards succeeded or not,
so no GPU idles through the audit. A run over several GPU nodes (`nodes`) has each node's
`stage_weights_NODE` (the node's own checks first) → `start_servers_NODE` … `stop_servers_NODE`
on its queue, all nodes at once; each shard claims the node with free capacity when it starts.

Nothing that costs GPU time starts before `preflight` has compiled the code, validated the config,
the prompts and the chat template. Clearing a failed shard resumes it where it stopped. A run
marked failed by hand stops its servers and ends failed (`stop_servers` fails it).
Outputs: `OUTPUT/data/*.parquet`, `OUTPUT/progress.json`, `OUTPUT/audit/report.html`.

The DAG only wires tasks; each task is one call of `regen.pipeline.run` with a stage's name
(`regen.stages`), which decides where the stage runs (here, its node, its SSH connection).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import Asset, AssetAlias, AssetAny, Param, dag, get_current_context, task

from regen.coordination.leases import APPROVAL_HOLD_S
from regen.dags.definitions import RunDefinition, queue, run_definitions, shard_pool, shard_retries
from regen.dags.notify import AlertNotifier
from regen.markdown import markdown_literal
from regen.dags.params import param_schemas

# Every finished dataset is announced under one alias: a training DAG schedules on
# AssetAlias("regen_dataset"); each event names the dataset's own Asset (its data/ folder) and
# carries its row count and audit verdict. A DAG from a deployment's config file also announces
# its own Asset, named `regenerate_NAME` (URI `regen://regenerate_NAME`), with the same extra.
DATASET = AssetAlias("regen_dataset")
QUEUE = queue()
SHARD_POOL = shard_pool()
SHARD_RETRIES, SHARD_RETRY_DELAY_S = shard_retries()


def _run(name: str, **kwargs):
    """The stage ``name`` of this run, where regen.pipeline places it; owned by this DAG run
    (its servers), whoever clears or retries it. The run's config is the deployment's with the
    conf's run fields over it: a conf that changes a deployment field fails here, before the
    stage runs (regen.config.deployment). Imported here: nothing heavy at parse time."""
    from airflow.sdk.log import mask_secret

    from regen.dags.definitions import triggered_config
    from regen.pipeline import run

    context = get_current_context()
    conf = dict(context["dag_run"].conf or {})
    if conf.get("api_key"):  # refused below; masked first, as Airflow masks no conf value by itself
        mask_secret(str(conf["api_key"]), "api_key")
    cfg = triggered_config(context["dag"].dag_id, conf)
    if cfg.servers.api_key:
        mask_secret(cfg.servers.api_key, "api_key")
    return run(name, cfg, run_id=f"{context['dag'].dag_id}/{context['run_id']}", **kwargs)


def _deadline(name: str) -> dict:
    """A task's execution_timeout: its stage's deadline (regen.stages) with the schema's startup
    timeout, set again just before it runs from the run's own values, plus the grace a remote stage
    gets to stop by itself on its node. A shard's is a backstop: regen holds its deadline, which
    moves with the shard's pace (regen.generate.shard_deadline_s)."""
    from regen.config.options import ServerOptions
    from regen.remote import DEADLINE_GRACE_S
    from regen.stages import stage

    def from_the_run(context) -> None:
        seconds = stage(name).deadline(float(context["params"]["startup_timeout_s"])) + DEADLINE_GRACE_S
        context["task"].execution_timeout = timedelta(seconds=seconds)

    startup = ServerOptions.model_fields["startup_timeout_s"].default
    return {"execution_timeout": timedelta(seconds=stage(name).deadline(startup) + DEADLINE_GRACE_S),
            "pre_execute": from_the_run}


@task(retries=0, **_deadline("preflight"))
def preflight(dag_nodes: list[str], dag_queue: str | None) -> list[int]:
    """The checks, then the output claimed: a run holding it is taken over only once Airflow says
    it has ended (regen.coordination.owner)."""
    from airflow.configuration import conf

    from regen.errors import RegenError
    from regen.pipeline import SETUP_FAILED, setup_failure
    from regen.preflight import PreflightFailed

    kwargs = {"dag_nodes": dag_nodes, "dag_queue": dag_queue, "max_map_length": conf.getint("core", "max_map_length")}
    ti = get_current_context()["ti"]
    try:
        try:
            return _run("preflight", ended_runs=[], **kwargs).shards
        except PreflightFailed as exc:
            holder = exc.held_by or ""
            dag_id, _, run_id = holder.partition("/")
            if not run_id or ti.get_dr_count(dag_id=dag_id, run_ids=[run_id], states=["queued", "running"]):
                raise
        return _run("preflight", ended_runs=[holder], **kwargs).shards
    except RegenError as exc:  # why, for the run page: this run's own, never written into the output
        ti.xcom_push(key=SETUP_FAILED, value=setup_failure("preflight", exc))
        raise


@task(retries=1, retry_delay=timedelta(seconds=10), **_deadline("stage_weights"))
def stage_weights(shards: list[int], node: str) -> str:
    from airflow.sdk.exceptions import AirflowSkipException

    if not shards:  # a scheduled run with nothing new: no weights, no servers, no requests
        raise AirflowSkipException("the dataset is up to date (see preflight); nothing to regenerate")
    return _run("stage_weights", node=node).path


@task(retries=0, **_deadline("start_servers"))
def start_servers(served_model_path: str, node: str) -> list[str]:
    return _run("start_servers", node=node, served_model_path=served_model_path).urls


@task(retries=0, **_deadline("canary"))
def canary() -> dict:
    """The canary on every node: a misconfigured node fails the run before the shards start."""
    return _run("canary").model_dump(mode="json")


@task.branch(retries=0, execution_timeout=timedelta(minutes=5))  # it reads a Param
def approval_gate(params=None) -> str:
    """Straight to the shards, or through a person's approval when the run asks for one."""
    return "approve" if params["approve_after_canary"] else "generate"


APPROVAL_BODY = """The canary of **{{ dag_run.dag_id }}** passed: {{ ti.xcom_pull(task_ids='canary')['estimate']['text'] }}.

{% for e in ti.xcom_pull(task_ids='canary')['examples'] %}
**{{ e.id | markdown_literal }}** ({{ e.turns }} turn(s))

> reasoning: {{ e.reasoning_content | markdown_literal }}
>
> answer: {{ e.content | markdown_literal }}
{% endfor %}
Approve to start the shards; reject to stop the run here (its servers are stopped)."""


@task(retries=SHARD_RETRIES, retry_delay=timedelta(seconds=SHARD_RETRY_DELAY_S), map_index_template="{{ shard_label }}",
      pool=SHARD_POOL, trigger_rule="none_failed_min_one_success",  # straight from the gate, or approved
      **_deadline("generate"))
def generate(shard: int, params=None) -> str:
    """A shard; its attempt has a deadline from the canary's estimate, moved by its own pace while
    its rows come in (a hung node or command fails it, and its retry resumes)."""
    from regen.generate import shard_deadline_s

    context = get_current_context()
    context["shard_label"] = f"shard {shard}"  # its count is the run's (preflight may have chosen it)
    estimate = (context["ti"].xcom_pull(task_ids="canary") or {}).get("estimate")
    result = _run("generate", shards=[shard], strict_index=True, deadline_s=shard_deadline_s(estimate))
    context["shard_label"] = f"shard {shard}/{result.shards[0].num_shards}"
    return "; ".join(result.summary)


@task(retries=0, **_deadline("audit"))
def audit() -> dict:
    """After the run's own servers are stopped (regen.pipeline), the audit; its verdict goes out
    with the dataset's Asset."""
    result = _run("audit")
    extra = {"rows": result.rows, "verdict": result.verdict,
             "degenerate_fraction": result.degenerate_fraction, "output": result.output}
    context = get_current_context()
    context["outlet_events"][DATASET].add(Asset(result.dataset_uri), extra=extra)
    for outlet in context["task"].outlets:
        if isinstance(outlet, Asset):
            context["outlet_events"][outlet].extra = extra
    return result.model_dump(mode="json")


@task(retries=1, retry_delay=timedelta(seconds=5), **_deadline("stop_servers"))
def stop_servers(node: str) -> int:
    """The node's servers stopped, whatever became of the run; then the run failed if a person
    marked it failed (regen.dags.runstate: Airflow would let it end green)."""
    from airflow.sdk.exceptions import AirflowFailException

    from regen.dags.runstate import marked_failed_by_hand

    stopped = _run("stop_servers", node=node).stopped
    context = get_current_context()
    run_id = context["run_id"]
    states = context["ti"].get_task_states(dag_id=context["dag"].dag_id, run_ids=[run_id]).get(run_id, {})
    answer = context["ti"].xcom_pull(task_ids="approve") if states.get("approve") == "success" else None
    reason = marked_failed_by_hand(states, {t.task_id for t in context["dag"].tasks if t.is_teardown},
                                   (answer or {}).get("chosen_options", [None])[0])
    if reason:
        raise AirflowFailException(f"{stopped} server(s) stopped; {reason}")
    return stopped


def regeneration_dag(run: RunDefinition):
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
        doc_md=run.doc_md(__doc__),
        tags=["regen", "llm-data"],
        user_defined_filters={"markdown_literal": markdown_literal},
        default_args={"on_failure_callback": [AlertNotifier()], "queue": run.config.queue or QUEUE},
    )
    def regenerate():
        shards = preflight([spec.name for spec in run.config.nodes], run.config.queue)
        generated = generate.expand(shard=shards)
        checked = canary()
        for spec in run.config.node_specs():  # each node's own tasks, on its queue, all at once
            on_node = {"queue": spec.queue or run.config.queue or QUEUE}
            model = stage_weights.override(task_id=spec.task_id("stage_weights"), **on_node)(shards, spec.name)
            servers = start_servers.override(task_id=spec.task_id("start_servers"), **on_node)(model, spec.name)
            servers >> checked
            generated >> stop_servers.override(task_id=spec.task_id("stop_servers"), **on_node)(
                spec.name).as_teardown(setups=servers, on_failure_fail_dagrun=True)
        gate = approval_gate()
        approvers = [{"id": user, "name": user} for user in run.config.canary.approvers] or None
        approve = ApprovalOperator(task_id="approve", subject="regen: start generating {{ dag_run.dag_id }}?",
                                   body=APPROVAL_BODY, assigned_users=approvers, retries=0,
                                   execution_timeout=timedelta(minutes=5),
                                   response_timeout=timedelta(seconds=APPROVAL_HOLD_S))  # as long as the servers wait
        checked >> gate >> [approve, generated]
        approve >> generated >> audit.override(outlets=outlets)()

    return regenerate()


# Broken config files are reported by regen_config_errors.py, so that they never hide these.
for _run_definition in run_definitions()[0]:
    globals()[_run_definition.dag_id] = regeneration_dag(_run_definition)

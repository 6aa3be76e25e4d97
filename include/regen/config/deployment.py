"""What a deployment decides and a run triggered in Airflow may not.

Anyone allowed to trigger a DAG writes its run conf. Airflow's security model leaves it to the
DAG's author that a conf cannot choose what the worker executes, so the fields that choose an
executable, a connection, a host, a directory root or the servers' key are the deployment's
(its config file, regen.dags.definitions): a conf that changes one is refused before anything
runs, naming the field and where the deployment sets it; a conf that leaves it out gets the
deployment's value. The CLI with ``--config`` (the operator's own shell) is not checked here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from regen.config.fields import ConfigError, did_you_mean
from regen.config.run import RunConfig, run_fields
from regen.objectstore import is_store_url

# Chosen by the deployment only: an executable (engine_python, remote_regen), a connection or a
# machine (ssh_conn_id, nodes, queue, node), where servers listen (host), a directory root
# (staging_dir, output_root), the servers' key and who may approve a run (approvers).
DEPLOYMENT_FIELDS = ("engine_python", "remote_regen", "ssh_conn_id", "nodes", "queue", "node", "host",
                     "staging_dir", "output_root", "work_dir", "output_conn_id", "api_key", "approvers")
_FLAG = re.compile(r"^--?[A-Za-z]")
MAX_CONF_BYTES = 256 * 1024


class DeploymentFieldError(ConfigError):
    """A run's conf asks for what only the deployment decides."""


def output_root(deployment: RunConfig) -> str:
    """Where a triggered run's output must lie: ``output_root``, or the folder of the
    deployment's own output."""
    return deployment.output_root or os.path.dirname(deployment.output.rstrip("/")) or "/"


def _inside(path: str, folder: str) -> bool:
    if is_store_url(path) or is_store_url(folder):
        return path == folder or path.startswith(folder.rstrip("/") + "/")
    return os.path.commonpath([path, folder]) == folder


def _resolved(location: str) -> str:
    """A folder's real path; an object-store URL as written, without a trailing slash."""
    return location.rstrip("/") if is_store_url(location) else os.path.realpath(location)


def _flags(args: Iterable[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if _FLAG.match(arg)}


def _folders_between(root: str, path: str) -> list[str]:
    """The folders from just under ``root`` down to ``path``'s parent."""
    parts = os.path.relpath(path, root).split(os.sep)[:-1]
    return [os.path.join(root, *parts[:i]) for i in range(1, len(parts) + 1)]


def _is_dataset(folder: str) -> bool:
    """A regen output: its manifest, or its published data next to its work folder."""
    return os.path.isfile(os.path.join(folder, "work", "manifest.json")) or (
        os.path.isdir(os.path.join(folder, "data")) and os.path.isdir(os.path.join(folder, "work")))


def triggered_run_config(deployment: RunConfig, where: str, conf: Mapping[str, Any] | None,
                         other_outputs: Mapping[str, str] | None = None) -> RunConfig:
    """The config a run triggered with ``conf`` runs with: the deployment's values, the conf's
    run fields over them. Every refusal is listed at once (DeploymentFieldError), each naming
    its field and ``where`` the deployment sets it; ``other_outputs`` (DAG id: output) are the
    datasets of the deployment's other DAGs, never a run's output."""
    from regen.engines import engine

    conf = dict(conf or {})
    size = len(json.dumps(conf, default=str))
    if size > MAX_CONF_BYTES:  # refused whole, never echoed: a run's fields fit in a few kB
        raise ConfigError(f"run conf: {size:,} bytes, more than the {MAX_CONF_BYTES:,} a run's conf may hold")
    problems = []
    # A key, not an empty one (`regen config --json` prints `api_key: null`); never echoed.
    if conf.get("api_key"):
        problems.append(f"api_key: the servers' key is the deployment's ({where}; empty there: a fresh key "
                        f"for each run); a run's conf is stored and shown with the run and may not hold it")
    unknown = sorted(set(conf) - set(run_fields()))
    if unknown:
        raise ConfigError("run conf: unknown field(s) " + ", ".join(f"{name!r}{did_you_mean(name, run_fields())}"
                          for name in unknown) + "; the fields are those of the trigger form")
    base = deployment.model_dump(mode="json")
    requested = RunConfig.from_mapping({**base, **{k: v for k, v in conf.items() if k != "api_key"}},
                                       source="run conf")
    for name in DEPLOYMENT_FIELDS:
        if name == "api_key" or name not in conf:
            continue
        asked, fixed = requested.flat_value(name), deployment.flat_value(name)
        if asked != fixed:
            shown = [n.model_dump(mode="json", exclude_defaults=True) for n in asked] if name == "nodes" else asked
            problems.append(f"{name}: set by the deployment ({where}: {base[name]!r}); a triggered run may not "
                            f"change it (its conf asks for {shown!r}). Change it there, or run `regen` with "
                            f"--config from the operator's shell")
    added = _flags(requested.servers.extra_server_args) - _flags(deployment.servers.extra_server_args)
    refused = sorted(added - engine(requested.engine).run_flags)
    if refused:
        problems.append(f"extra_server_args: {', '.join(refused)} may not be added by a triggered run (it may add "
                        f"tuning flags of {requested.engine}: {', '.join(sorted(engine(requested.engine).run_flags))}; "
                        f"anything else is the deployment's, in {where})")
    idle, ceiling = requested.servers.idle_shutdown_s, deployment.servers.idle_shutdown_s
    if ceiling is not None and (idle is None or idle > ceiling):
        problems.append(f"idle_shutdown_s: a triggered run's servers stop after at most the deployment's "
                        f"{ceiling:g} s idle ({where}); its conf asks for {'never' if idle is None else f'{idle:g} s'}")
    root = _resolved(output_root(deployment))
    out = _resolved(requested.output)
    if out == root or not _inside(out, root):
        problems.append(f"output {requested.output}: a triggered run writes in a folder under the deployment's "
                        f"output root {root} (output_root, or the folder of output, in {where})")
    else:
        holder = None if is_store_url(out) else next(
            (folder for folder in _folders_between(root, out) if _is_dataset(folder)), None)
        if holder is not None:
            problems.append(f"output {requested.output}: inside the dataset {holder}; a run's output is a folder "
                            f"of its own, never inside another output (its data/ would mix two runs)")
    for dag_id, other in (other_outputs or {}).items():
        other = _resolved(other)
        if _inside(out, other) or _inside(other, out):
            problems.append(f"output {requested.output}: holds the dataset of DAG {dag_id} ({other})")
    if problems:
        raise DeploymentFieldError("run conf refused:\n- " + "\n- ".join(problems))
    return requested.model_copy(update={name: base[name] for name in DEPLOYMENT_FIELDS})

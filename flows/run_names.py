"""Flow-run names that say what a run is: `pipeline-<run dir>-<6 hex>` instead of Prefect's "myrtle-squid".

A UI probe found every run, its CPU-stages subflow and its extraction run on the GPU pool under random names:
the runs list did not say which run directory or stage a run was. The name is the flow's name without the
`eagle3-` prefix, the last component of the run directory, and the end of the flow run's id (random in every
UUID version Prefect uses), so two runs of one directory started together stay apart and a UI Retry of a run,
which renames it again in a new process, gives it the same name. The extraction run the pipeline starts on the
GPU pool is named by the pipeline (`handoff_name`): `extract-<run dir>-for-<pipeline run's name>`.

The name is computed as the run starts, before any task: it reads the run form and at most the YAML file the
form names, never a block, the tokenizer or the network, and it never raises (a run whose config does not
resolve fails later, saying why, under a plain `pipeline-<6 hex>`).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import yaml

from flows.params import RunParameters
from tasks.common.config import PipelineConfig, apply_overrides

FLOW_PREFIX = "eagle3-"
ID_CHARS = 6


def short_flow_name(flow_name: str) -> str:
    """`eagle3-pipeline` -> `pipeline`: the runs list shows the flow's full name beside the run's already."""
    return flow_name.removeprefix(FLOW_PREFIX)


def run_dir_of_form(form: RunParameters) -> str | None:
    """The run directory's last component as the run form sets it (the YAML or the inline config, then the
    overrides); None when the form does not say. A block may move the directory (an artifact store maps it to
    its own root) but keeps its last component, so no block is loaded."""
    if form.config_path is not None:
        path = Path(form.config_path)
        raw = yaml.safe_load(path.read_text())
    else:
        path, raw = None, dict(form.config or {})
    if not isinstance(raw, dict):
        return None
    value = apply_overrides(raw, form.overrides).get("run_dir")
    if not isinstance(value, str | Path) or not str(value).strip():
        return None
    run_dir = Path(value)
    if path is not None and not run_dir.is_absolute():  # relative to the YAML file, as load_config reads it
        run_dir = path.resolve().parent / run_dir
    return run_dir.resolve().name or None


def run_dir_label(parameters: dict[str, Any]) -> str | None:
    """The run directory's name from a flow's parameters: a `run` form (the pipeline and stage flows), a
    resolved `cfg` (the CPU-stages subflow) or a `run_dir` path (train, evaluate); None when none tells it."""
    try:
        if "run" in parameters:
            run = parameters["run"]
            return run_dir_of_form(run if isinstance(run, RunParameters) else RunParameters.model_validate(run))
        cfg = parameters.get("cfg")
        if isinstance(cfg, PipelineConfig):
            return cfg.run_dir.name or None
        run_dir = parameters.get("run_dir")
        if isinstance(run_dir, str | Path) and str(run_dir).strip():
            return Path(run_dir).resolve().name or None
    except Exception:  # a name must never fail a run: the run reports its bad config itself, later
        return None
    return None


def run_name(flow_name: str, parameters: dict[str, Any], run_id: uuid.UUID | str | None) -> str:
    """`<flow>-<run dir>-<end of the run id>`, or `<flow>-<end of the run id>` when the run directory cannot be
    told from the parameters (see the module docstring)."""
    tail = str(run_id or uuid.uuid4()).replace("-", "")[-ID_CHARS:]
    label = run_dir_label(parameters)
    return "-".join(part for part in (short_flow_name(flow_name), label, tail) if part)


def flow_run_name() -> str:
    """The `flow_run_name` callable of every flow here (Prefect calls it without arguments, inside the new run's
    context). A name this project gave already (`extract-...-for-...`, set by the pipeline when it started the
    run on the GPU pool) is kept: Prefect calls this for deployment runs too, and would replace it."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow is None:  # no run to name (never under Prefect)
        return f"eagle3-run-{uuid.uuid4().hex[-ID_CHARS:]}"
    flow_name = context.flow.name
    current = context.flow_run.name or ""
    if current.startswith(f"{short_flow_name(flow_name)}-"):
        return current
    return run_name(flow_name, dict(context.parameters or {}), context.flow_run.id)


def handoff_name(run_dir_name: str, parent_run_name: str | None) -> str:
    """The name of the extraction run the pipeline starts on the GPU pool: `extract-<run dir>-for-<the
    pipeline run's name>`, so the GPU pool's runs list says which run directory and which run it works for."""
    parent = f"-for-{parent_run_name}" if parent_run_name else ""
    return f"extract-{run_dir_name}{parent}"

"""The pipeline's hand-off of hidden-state extraction to the GPU pool's deployment, and the wait for it.

Invariant: the CPU worker never loads the target model, and the pipeline never waits silently for a GPU worker
that is not there: the moment the extraction run is created it checks the run's work pool for a live worker,
logs at once when there is none (what to start, how long it waits), and when none has taken the run after
`RunParameters.extract_worker_wait_s` it cancels that run and fails with one clear message. Everything before
extraction is finished and kept, so a rerun with a GPU worker resumes at extraction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from prefect import get_run_logger
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName, WorkerFilter, WorkerFilterStatus
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled

from flows.params import RunParameters
from flows.run_names import handoff_name
from tasks.common.errors import ConfigError, ExtractDeploymentError

EXTRACT_POLL_S = 1.0
"""How often the extraction run's state is read (Prefect's own default is 5 s: 2.5 s lost on average)."""

WORKER_HINT = "`prefect worker start --pool {pool} --type process --limit 1`, as the GPU image does"


def live_workers(client: SyncPrefectClient, pool: str) -> int:
    online = WorkerFilter(status=WorkerFilterStatus(any_=["ONLINE"]))
    return len(client.read_workers_for_work_pool(pool, worker_filter=online))


def require_extract_deployment(name: str) -> None:
    """Refuse a hand-off to a deployment the server does not have before the run sends anything: the probe's
    typo'd `eagle3-extract/nope` paid for generation and failed only at the hand-off, with `ObjectNotFound: None`."""
    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
        except (ObjectNotFound, ValueError):  # ValueError: not `<flow>/<deployment>`
            raise ConfigError(
                f"extract_deployment {name!r}: no such deployment; deployed: {_deployed(client, name)}"
            ) from None


def _deployed(client: SyncPrefectClient, name: str) -> str:
    """The deployments of the flow `name` names (`eagle3-extract/...`), or of `eagle3-extract` when it names none."""
    flow_name = name.split("/", 1)[0] if "/" in name else "eagle3-extract"
    flows = FlowFilter(name=FlowFilterName(any_=[flow_name]))
    found = client.read_deployments(flow_filter=flows, limit=50)
    return ", ".join(sorted(f"{flow_name}/{d.name}" for d in found)) or f"none of flow {flow_name}"


def extract_on_deployment(run: RunParameters, run_dir_name: str) -> list[dict[str, Any]]:
    """Start the extraction deployment as a subflow run and wait for it (see the module docstring). The run is
    named `extract-<run dir>-for-<this run's name>` (`handoff_name`): the GPU pool's runs list named it at random."""
    from prefect.runtime import flow_run as this_run

    name = run.extract_deployment or ""
    params = run.model_copy(update={"extract_deployment": None}).model_dump(mode="json")
    run_name = handoff_name(run_dir_name, this_run.name)
    flow_run = cast(
        FlowRun,
        run_deployment(name, parameters={"run": params}, as_subflow=True, timeout=0, flow_run_name=run_name),
    )
    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        final = await_extract_run(client, flow_run, name, run.extract_worker_wait_s, logger.warning)
    if final.state is None or not final.state.is_completed():
        message = final.state.message if final.state else "no state"
        raise ExtractDeploymentError(f"{name} run {final.name} ended {message}")
    return [{"deployment": name, "flow_run": str(final.id), "state": final.state.name}]


def await_extract_run(
    client: SyncPrefectClient,
    flow_run: FlowRun,
    deployment: str,
    worker_wait_s: float,
    warn: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
) -> FlowRun:
    """Poll until the run is final. While it waits to be picked up (still Scheduled) and its pool has no live
    worker for `worker_wait_s` in a row, cancel it and raise ExtractDeploymentError."""
    pool = flow_run.work_pool_name or "?"
    alone_since: float | None = None
    while True:
        current = client.read_flow_run(flow_run.id)
        state = current.state
        if state is not None and state.is_final():
            return current
        waiting = state is None or state.is_scheduled()
        if waiting and live_workers(client, pool) == 0:
            if alone_since is None:
                alone_since = clock()
                warn(
                    f"no worker is polling work pool {pool!r} for {deployment} run {current.name}: start one "
                    f"({WORKER_HINT.format(pool=pool)}); waiting up to {worker_wait_s:g} s (extract_worker_wait_s)"
                )
            elif clock() - alone_since >= worker_wait_s:
                message = (
                    f"no worker on work pool {pool!r} took {deployment} run {current.name} within {worker_wait_s:g} s "
                    f"(extract_worker_wait_s): start one ({WORKER_HINT.format(pool=pool)}) and rerun; every stage "
                    "before extraction is finished and kept"
                )
                client.set_flow_run_state(current.id, Cancelled(message=message), force=True)
                raise ExtractDeploymentError(message)
        elif alone_since is not None:
            alone_since = None
            warn(f"a worker is polling work pool {pool!r} now; {deployment} run {current.name} is queued there")
        time.sleep(EXTRACT_POLL_S)

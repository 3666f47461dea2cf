"""Task runs left "Running" under a flow run that crashed, closed when the next eagle3 run starts.

A host killed mid-run cannot report anything: the heartbeat automation (deployments/automations.yaml) marks its
flow run Crashed, but Prefect 3.9 closes the child task runs only of a *cancelled* flow run
(`server/services/cancellation_cleanup.py`), so the UI kept showing the dead run's generate task as Running, its
progress card half full, forever. The next run of any eagle3 deployment (the user pressing Run again, or the
nightly schedule) marks those task runs Crashed, saying which flow run died and quoting its state message (the
heartbeat automation's, or the worker's "Process exited with status code: -9"), before it does anything else.
The work is O(crashed runs x parts), never per sample, and a failure here is a warning: it must not stop a run.
"""

from __future__ import annotations

from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.logging.loggers import flow_run_logger
from prefect.states import Crashed

RUN_TAG = "eagle3"
"""The tag every eagle3 deployment gives its runs (prefect.yaml), which deployments/automations.yaml matches."""

RECENT_CRASHED_RUNS = 50
"""Crashed runs looked at per start, newest first: older ones were closed by the runs in between."""

OPEN_STATES = [StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.PAUSED]


def close_crashed_leftovers(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect `on_running` hook of every eagle3 flow; see the module docstring. Never raises. It logs to the
    starting flow run's own log (a plain logger reached only the worker's stdout, not the UI)."""
    logger = flow_run_logger(flow_run, flow)
    try:
        closed = close_task_runs_of_crashed_flow_runs()
    except Exception as exc:  # the hook must never stop the run it starts
        logger.warning("task runs of crashed flow runs not closed: %s: %s", type(exc).__name__, exc)
        return
    if closed:
        logger.info("closed %d task runs left Running by crashed flow runs: %s", len(closed), ", ".join(closed))


def close_task_runs_of_crashed_flow_runs() -> list[str]:
    """Mark Crashed every open task run of the newest crashed eagle3 flow runs; returns their names."""
    closed: dict[Any, str] = {}  # task run id -> name
    with get_client(sync_client=True) as client:
        crashed = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CRASHED])),
                tags=FlowRunFilterTags(all_=[RUN_TAG]),
            ),
            sort=FlowRunSort.START_TIME_DESC,
            limit=RECENT_CRASHED_RUNS,
        )
        if not crashed:
            return []
        messages: dict[Any, str] = {run.id: leftover_message(run) for run in crashed}
        while True:
            task_runs = [
                t
                for t in client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(messages))),
                    task_run_filter=TaskRunFilter(
                        state=TaskRunFilterState(type=TaskRunFilterStateType(any_=OPEN_STATES))
                    ),
                    limit=200,
                )
                if t.id not in closed
            ]
            if not task_runs:
                return list(closed.values())
            for task_run in task_runs:
                client.set_task_run_state(
                    task_run.id,
                    Crashed(message=messages.get(task_run.flow_run_id, f"its flow run {task_run.flow_run_id} crashed")),
                    force=True,
                )
                closed[task_run.id] = task_run.name


CAUSE_CHARS = 200
"""The crashed run's own message is quoted up to this many characters (its first line)."""


def leftover_message(crashed_run: Any) -> str:
    """A leftover task run's message: which flow run crashed and why, in that run's own state message (a process
    killed by a signal, a heartbeat lost): a fixed 'no heartbeat: its host died' misreported a `kill -9` of the
    flow process under a live worker."""
    state = crashed_run.state
    lines = [line.strip() for line in str(getattr(state, "message", None) or "").splitlines() if line.strip()]
    cause = lines[0][:CAUSE_CHARS] if lines else "no cause recorded"
    return f"its flow run {crashed_run.name} crashed ({cause}); rerunning resumes from what that run had finished"

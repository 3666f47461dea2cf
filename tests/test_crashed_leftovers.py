"""A crashed eagle3 flow run's open task runs are closed when the next eagle3 flow starts (flows/crashed_leftovers.py):
Prefect closes a cancelled run's task runs itself, never a crashed one's, so the UI showed a dead host's task as
Running forever."""

from __future__ import annotations

import time

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.states import Crashed, Running

from flows.pipeline import FLOW_OPTIONS


@task
def stage_part() -> None:
    """Stands for any stage's task: only its name and state are used."""


@flow(name="eagle3-leftovers-probe", **FLOW_OPTIONS)
def next_run() -> None:
    """Any eagle3 flow: the hook is in FLOW_OPTIONS, which every pipeline and stage flow uses."""


@pytest.mark.usefixtures("prefect_harness")
def test_the_next_run_closes_the_task_runs_a_crashed_run_left_running() -> None:
    with get_client(sync_client=True) as client:

        def flow_run_with_a_running_task(
            tags: list[str], crash: bool, why: str | None = "no heartbeat for 90 s"
        ) -> tuple[str, object]:
            run = client.create_flow_run(next_run, tags=tags, state=Running())
            task_run = client.create_task_run(stage_part, flow_run_id=run.id, dynamic_key=str(run.id), state=Running())
            if crash:
                client.set_flow_run_state(run.id, Crashed(message=why), force=True)
            return run.name, task_run.id

        # kill -9 of the flow process under a live worker (a UI probe): not a dead host, as the message had said
        dead_name, dead_task = flow_run_with_a_running_task(
            ["eagle3"], crash=True, why="Process exited with status code: -9"
        )
        _, silent_task = flow_run_with_a_running_task(["eagle3"], crash=True, why=None)
        _, alive_task = flow_run_with_a_running_task(["eagle3"], crash=False)
        _, foreign_task = flow_run_with_a_running_task(["someone-else"], crash=True)

        next_run()
        this_run_name = max(client.read_flow_runs(), key=lambda r: r.created or r.expected_start_time).name

        dead = client.read_task_run(dead_task).state
        assert dead is not None and dead.type.value == "CRASHED", dead
        assert dead.message is not None and dead_name in dead.message and "crashed" in dead.message
        assert "(Process exited with status code: -9)" in dead.message and "host died" not in dead.message
        silent = client.read_task_run(silent_task).state
        assert silent is not None and "host died" not in (silent.message or ""), silent
        for other in (alive_task, foreign_task):  # a live run, and a crashed run that is not this tool's
            state = client.read_task_run(other).state
            assert state is not None and state.type.value == "RUNNING", state

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the UI reads the run's log from the API: the line must be there, not on stdout
    wanted = "closed 2 task runs left Running by crashed flow runs"
    messages: list[str] = []
    with get_client(sync_client=True) as client:
        (this_run,) = [r for r in client.read_flow_runs() if r.name == this_run_name]
        only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[this_run.id]))
        for _ in range(50):  # the log worker writes in batches
            messages = [log.message for log in client.read_logs(log_filter=only_this_run)]
            if any(wanted in m for m in messages):
                break
            time.sleep(0.2)
    assert any(wanted in m for m in messages), messages

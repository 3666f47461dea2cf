"""How a run the cost cap ended shows in Prefect: a plain Completed state whose message starts "BudgetStopped",
the flow-run tag `budget-stopped`, and the event `eagle3.run.budget-stopped` the cost-cap automation reacts to.

Why not a custom state name: the UI's deployment page lists runs by state *name* (every built-in name but
Scheduled), so a run completed as "BudgetStopped" vanished from it. A tag and an event carry the same fact
without hiding the run.
"""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.events import emit_event

BUDGET_TAG = "budget-stopped"
BUDGET_EVENT = "eagle3.run.budget-stopped"


def mark_budget_stopped(message: str) -> None:
    """Tag the current flow run and emit the event; outside a flow run, nothing to mark."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    flow_run = context.flow_run
    tags = sorted({*flow_run.tags, BUDGET_TAG})
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, tags=tags)
    emit_event(
        event=BUDGET_EVENT,
        resource={"prefect.resource.id": f"prefect.flow-run.{flow_run.id}", "prefect.resource.name": flow_run.name},
        related=[{"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"} for tag in tags],
        payload={"message": message},
    )

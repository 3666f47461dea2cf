"""Generate progress in the Prefect UI: a progress artifact, a status markdown artifact, a per-dataset table.

Why the listener carries its own ids and settings: the engine calls listeners from a worker thread, where
Prefect's run context (the task run id, the API settings of a test harness or an ephemeral server) is not
set, or is a copy whose API client belongs to another thread. So it captures ids and settings in the task
and makes each call in a fresh, empty context with its own client.

Why throttled: every markdown update is a new artifact version, kept forever; one every 15 s over a 30-minute
run is about 120 versions, one per snapshot would be 900.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.context import SettingsContext, get_settings_context
from prefect.utilities.context import get_task_and_flow_run_ids

from tasks.common.config import PipelineConfig
from tasks.generate.dataset_summary import dataset_rows
from tasks.generate.progress import ProgressSnapshot, status_fields, status_line

PROGRESS_KEY = "generate-progress"
STATUS_KEY = "generate-status"
SUMMARY_KEY = "generate-summary"
PUBLISH_EVERY_S = 15.0

T = TypeVar("T")


def status_markdown(snapshot: ProgressSnapshot) -> str:
    heading = "final" if snapshot.final else "in progress"
    lines = [f"# generate: {heading}", "", "| | |", "|---|---|"]
    lines += [f"| {label} | {value.replace('|', '/')} |" for label, value in status_fields(snapshot, top_reasons=10)]
    return "\n".join(lines)


class PrefectProgressListener:
    """Create inside a Prefect task (or flow) run; pass to `generate_parts(listeners=[...])`."""

    def __init__(self, every_s: float = PUBLISH_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        task_run_id, flow_run_id = get_task_and_flow_run_ids()
        if task_run_id is None and flow_run_id is None:
            raise RuntimeError("PrefectProgressListener must be created inside a Prefect flow or task run")
        self.task_run_id: UUID | None = task_run_id
        self.flow_run_id: UUID | None = flow_run_id
        self._settings = get_settings_context()
        self._every_s = every_s
        self._clock = clock
        self._last: float | None = None
        self._lock = threading.Lock()
        initial = self._artifact("progress", PROGRESS_KEY, 0.0, "generate: waiting for the first results")
        self.progress_id: UUID = self._call(lambda client: client.create_artifact(initial).id)

    def _artifact(self, kind: str, key: str, data: Any, description: str | None = None) -> ArtifactCreate:
        return ArtifactCreate(
            type=kind,
            key=key,
            data=data,
            description=description,
            task_run_id=self.task_run_id,
            flow_run_id=self.flow_run_id,
        )

    def _call(self, fn: Callable[[SyncPrefectClient], T]) -> T:
        def run() -> T:
            settings = SettingsContext(profile=self._settings.profile, settings=self._settings.settings)
            with settings, get_client(sync_client=True) as client:
                return fn(client)

        return contextvars.Context().run(run)

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            now = self._clock()
            if not snapshot.final and self._last is not None and now - self._last < self._every_s:
                return
            self._last = now
            self._call(lambda client: self._publish(client, snapshot))

    def _publish(self, client: SyncPrefectClient, snapshot: ProgressSnapshot) -> None:
        progress = min(100.0, max(0.0, snapshot.percent))
        client.update_artifact(self.progress_id, ArtifactUpdate(data=progress, description=status_line(snapshot)))
        client.create_artifact(self._artifact("markdown", STATUS_KEY, status_markdown(snapshot)))


def publish_generate_summary(cfg: PipelineConfig, parts: list[int]) -> list[dict[str, Any]]:
    """Table artifact, one row per dataset, of what the run directory holds for `parts`; call inside a run."""
    rows = dataset_rows(Path(cfg.run_dir), parts)
    create_table_artifact(
        key=SUMMARY_KEY,
        table=rows,
        description=f"Responses per dataset in {cfg.run_dir} (pending: samples without a row yet)",
    )
    return rows

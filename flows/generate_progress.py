"""Generate progress in the Prefect UI and in the task's log: one progress card updated in place, a log line at
a steady interval, one log line per outage start and end, and a per-dataset table at the end.

Why the listener carries its own ids and settings: the engine calls listeners from a worker thread, where
Prefect's run context (the task run id, the API settings of a test harness or an ephemeral server) is not
set, or is a copy whose API client belongs to another thread. So it captures ids and settings in the task
and makes each call in a fresh, empty context with its own client.

Why one card updated in place: every `create_artifact` with a key is a new card in the run's Artifacts tab (two
`generate-status` cards for one run); `update_artifact` rewrites the one card the task created.
"""

from __future__ import annotations

import contextvars
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.client.schemas.objects import StateType
from prefect.context import SettingsContext, get_settings_context
from prefect.utilities.context import get_task_and_flow_run_ids

from flows.artifact_keys import run_key
from tasks.common.config import PipelineConfig
from tasks.generate.dataset_summary import dataset_rows
from tasks.generate.progress import (
    ProgressSnapshot,
    RunEvent,
    add_event_listener,
    event_line,
    format_counts,
    format_duration,
    format_usd,
    heading,
    status_fields,
)

Logger = logging.Logger | logging.LoggerAdapter[Any]

PROGRESS_KEY = "generate-progress"
SUMMARY_KEY = "generate-summary"
PUBLISH_EVERY_S = 5.0
LOG_EVERY_S = 30.0

T = TypeVar("T")


def status_markdown(snapshot: ProgressSnapshot) -> str:
    lines = [f"**generate: {heading(snapshot)}**", "", "| | |", "|---|---|"]
    lines += [f"| {label} | {value.replace('|', '/')} |" for label, value in status_fields(snapshot, top_reasons=10)]
    if snapshot.retries_by_reason:
        lines.append(f"| retries by reason | {format_counts(snapshot.retries_by_reason, 10)} |")
    return "\n".join(lines)


def log_line(s: ProgressSnapshot) -> str:
    """What the generate task logs at a steady interval: sent, done, failed, retries by reason, in flight, spend."""
    parts = [
        f"generate {s.finished:,}/{s.total:,} ({s.percent:.1f}%)",
        f"sent {s.requests_sent:,}",
        f"done {s.done:,}",
        f"failed {s.failed:,}" + (f" ({format_counts(s.failures_by_reason, 5)})" if s.failures_by_reason else ""),
        f"retries {s.retries:,}" + (f" ({format_counts(s.retries_by_reason, 5)})" if s.retries_by_reason else ""),
        f"in flight {s.in_flight:,}/{s.window:,}",
        f"billed {format_usd(s.spent_usd)} run-dir total ({format_usd(s.cost_usd)} this run), "
        f"pending {format_usd(s.pending_usd)}",
    ]
    if s.endpoint_down_since_s is not None:
        parts.append(f"endpoint down for {format_duration(s.elapsed_s - s.endpoint_down_since_s)}")
    if s.outages:
        parts.append(f"outages {s.outages}")
    if s.final and s.stopped is not None:
        parts.append(heading(s))
    return ", ".join(parts)


class _Throttle:
    """The first snapshot and the final one always pass; the others at most once per `every_s`. Not locked:
    each listener calls it under its own lock."""

    def __init__(self, every_s: float, clock: Callable[[], float]) -> None:
        self._every_s = every_s
        self._clock = clock
        self._last: float | None = None

    def due(self, snapshot: ProgressSnapshot) -> bool:
        now = self._clock()
        if not snapshot.final and self._last is not None and now - self._last < self._every_s:
            return False
        self._last = now
        return True


class LogProgressListener:
    """Logs `log_line` for the first snapshot, then every `every_s`, and for the final one: the generate task's
    log tells what happened even where no artifact is looked at."""

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._throttle = _Throttle(every_s, clock)
        self._lock = threading.Lock()

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            if not self._throttle.due(snapshot):
                return
        self._logger.info(log_line(snapshot))


@contextmanager
def logged_events(logger: Logger) -> Iterator[None]:
    """One log line per run event (outage start and end, budget stop, settled spend) while the block runs."""

    def log(event: RunEvent) -> None:
        level = logging.INFO if event.kind in ("outage_end", "settled") else logging.WARNING
        logger.log(level, event_line(event))

    remove = add_event_listener(log)
    try:
        yield
    finally:
        remove()


class PrefectProgressListener:
    """Create inside a Prefect task (or flow) run; pass to `generate_parts(listeners=[...])`. Keeps one progress
    card (`generate-progress`: percent done, with the status table as its description) current."""

    def __init__(
        self, key: str = PROGRESS_KEY, every_s: float = PUBLISH_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        task_run_id, flow_run_id = get_task_and_flow_run_ids()
        if task_run_id is None and flow_run_id is None:
            raise RuntimeError("PrefectProgressListener must be created inside a Prefect flow or task run")
        self.task_run_id: UUID | None = task_run_id
        self.flow_run_id: UUID | None = flow_run_id
        self._settings = get_settings_context()
        self._throttle = _Throttle(every_s, clock)
        self._lock = threading.Lock()
        if flow_run_id is not None:
            self._call(lambda client: retire_progress_cards(client, flow_run_id, key, SUPERSEDED))
        initial = self._artifact("progress", key, 0.0, "**generate**: waiting for the first results")
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
            if not self._throttle.due(snapshot):
                return
            self._call(lambda client: self._publish(client, snapshot))

    def _publish(self, client: SyncPrefectClient, snapshot: ProgressSnapshot) -> None:
        progress = min(100.0, max(0.0, snapshot.percent))
        update = ArtifactUpdate(data=progress, description=status_markdown(snapshot))
        client.update_artifact(self.progress_id, update)


OPEN_CARD_HEADINGS = ("**generate: in progress**", "**generate**: waiting")
"""How a card that no attempt finished begins (`status_markdown`, the listener's first description)."""
SUPERSEDED = "an earlier attempt of this flow run, ended before it finished: the newest card is current"


def closed_card(description: str, why: str) -> str:
    """An open card's text as a card cut short reads (`heading`, `_eta`): a retired card kept "generate: in
    progress", an ETA, requests in flight and money reserved below the note that said its run had ended."""
    lines = []
    for line in description.splitlines():
        if line.startswith(OPEN_CARD_HEADINGS):
            line = f"**generate: stopped: {why}**"
        elif line.startswith("| ETA |"):
            line = f"| ETA | none: stopped ({why}) |"
        elif line.startswith("| in flight |"):
            line = "| in flight | none: its attempt ended |"
        elif line.startswith("| budget |"):
            line = re.sub(r"\$[0-9,.]+ reserved", "nothing reserved", line)
        lines.append(line)
    return "\n".join(lines)


def retire_progress_cards(
    client: SyncPrefectClient, flow_run_id: UUID, key: str, note: str, percent: float | None = None
) -> int:
    """Progress cards an earlier attempt of this flow run left (a task retry, or the UI's Retry of a crashed run):
    each still open is told it is finished with, `note` first in its description (and set to `percent`, when
    given). A retried run that found nothing left to send kept the crashed attempt's card at 50% "in progress"
    on a Completed run. Open cards other flow runs left when they ended are retired first
    (`retire_cards_of_ended_runs`); the count returned is this run's."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    retire_cards_of_ended_runs(client, flow_run_id, key)
    cards = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
        )
    )
    retired = 0
    for card in cards:
        if not (card.description or "").startswith(OPEN_CARD_HEADINGS):
            continue
        data = percent if percent is not None else card.data
        closed = closed_card(card.description or "", "an earlier attempt of this flow run")
        client.update_artifact(card.id, ArtifactUpdate(data=data, description=f"**{note}**\n\n{closed}"))
        retired += 1
    return retired


ENDED_STATES = frozenset({StateType.CRASHED, StateType.FAILED, StateType.CANCELLED})


def retire_cards_of_ended_runs(client: SyncPrefectClient, flow_run_id: UUID, key: str) -> int:
    """Open progress cards under `key` (one run directory's) that other flow runs left when they ended before
    their generate did (a worker `kill -9`ed, then a new trigger instead of the UI's Retry): each is told which
    flow run took over. A crashed run's page kept its card "in progress" at the percent it reached for good.
    Runs not yet ended are left alone: a run the server has not yet marked crashed may still be running."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    cards = [
        card
        for card in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
        if card.flow_run_id not in (None, flow_run_id) and (card.description or "").startswith(OPEN_CARD_HEADINGS)
    ]
    if not cards:
        return 0
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list({card.flow_run_id for card in cards})))
    )
    ended = {run.id: run for run in runs if run.state is not None and run.state.type in ENDED_STATES}
    this_run = client.read_flow_run(flow_run_id)
    retired = 0
    for card in cards:
        run = ended.get(card.flow_run_id)  # type: ignore[arg-type]
        if run is None or run.state is None:
            continue
        note = (
            f"this run ended {run.state.name} before its generate finished; "
            f"flow run {this_run.name} ({flow_run_id}) took over"
        )
        closed = closed_card(card.description or "", f"its run ended {run.state.name}")
        client.update_artifact(card.id, ArtifactUpdate(description=f"**{note}**\n\n{closed}"))
        retired += 1
    return retired


def retire_progress_of_this_run(key: str, note: str, percent: float | None = None) -> int:
    """`retire_progress_cards` for the flow run this is called in (a flow or task run context)."""
    _, flow_run_id = get_task_and_flow_run_ids()
    if flow_run_id is None:
        return 0
    with get_client(sync_client=True) as client:
        return retire_progress_cards(client, flow_run_id, key, note, percent)


def publish_generate_summary(cfg: PipelineConfig, parts: list[int]) -> list[dict[str, Any]]:
    """Table artifact, one row per dataset, of what the run directory holds for `parts`; call inside a run."""
    rows = dataset_rows(Path(cfg.run_dir), parts)
    create_table_artifact(
        key=run_key(SUMMARY_KEY, cfg.run_dir),
        table=rows,
        description=f"Responses per dataset in {cfg.run_dir} (pending: samples without a row yet)",
    )
    return rows

"""The failed samples of a run as Prefect table artifacts, one per dataset: which samples failed, where, why, after
how many attempts, and what the next run does about each, readable in the UI without the worker's disk.

Invariant: the rows are `FailureRecord`s (the columns of `failed_samples.jsonl` and `status`,
`tasks.common.failures.FAILURE_COLUMNS`), failed samples in stage order before quarantined rows, at most
`ROWS_PER_DATASET` per dataset, and the description names the file that holds all of them. A dataset of the run
with no failed sample and no quarantined row gets an empty table saying so: the key's latest version showed the
failures a later run had since retried (its description says so only when that version listed any).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import TableArtifact

from flows.artifact_keys import run_key, slug
from tasks.status.report import display_cell

ROWS_PER_DATASET = 300
KEY_PREFIX = "failed-samples-"
COLUMNS = ("sample_id", "reason", "class", "rerun", "attempts", "stage", "dataset", "last_error")
"""`FAILURE_COLUMNS` in the order a reader needs them: the UI's table cuts long rows off on the right, so what
went wrong and what the next run does come first, the long last error last."""


def artifact_key(dataset: str, run_dir: Path | str) -> str:
    """`failed-samples-b1-run` for dataset `B1` of run directory `runs/run` (`flows.artifact_keys`)."""
    return run_key(KEY_PREFIX + (slug(dataset) or "dataset"), run_dir)


RETRIED_NOTE = " (older versions of this key show failures since retried)"


def _retried_note(key: str) -> str:
    """`RETRIED_NOTE` only when an older version listed failed samples: the latest one did, or said so itself.
    The empty table of a first run, or of a directory that never had a failure, claimed failures that never were."""
    from prefect.artifacts import Artifact

    latest = Artifact.get(key)  # None: no version of the key yet
    data = getattr(latest, "data", None)
    rows = json.loads(data) if isinstance(data, str) else data
    return RETRIED_NOTE if rows or RETRIED_NOTE in str(getattr(latest, "description", "") or "") else ""


def table_rows(records: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{column: display_cell(r, column) for column in COLUMNS} for r in records]


def publish_failed_samples(
    records: list[dict[str, Any]],
    failed_file: Path,
    run_dir: Path,
    datasets: Iterable[str] = (),
    flow_run_id: UUID | None = None,
) -> list[str]:
    """One table artifact per dataset in `datasets` or in `records`, empty for one without failed samples or
    quarantined rows; returns their keys. `flow_run_id` attaches them to a run from outside its context (an
    on-failure hook)."""
    per: dict[str, list[dict[str, Any]]] = {dataset: [] for dataset in datasets}
    for record in records:
        per.setdefault(str(record["dataset"]), []).append(record)
    keys = []
    for dataset, rows in sorted(per.items()):
        key = artifact_key(dataset, run_dir)
        classes = Counter(str(r["class"]) for r in rows)
        shown = f"the first {ROWS_PER_DATASET} shown" if len(rows) > ROWS_PER_DATASET else "all shown"
        description = (
            (
                f"{len(rows)} failed samples and quarantined rows of dataset {dataset} ({shown}; "
                + ", ".join(f"{k} {n}" for k, n in classes.most_common())
                + f"). Every one, with the same columns: {failed_file}"
            )
            if rows
            else f"No failed samples or quarantined rows in dataset {dataset} now{_retried_note(key)}."
        )
        TableArtifact(
            key=key, table=table_rows(rows[:ROWS_PER_DATASET]), description=description, flow_run_id=flow_run_id
        ).create()
        keys.append(key)
    return keys

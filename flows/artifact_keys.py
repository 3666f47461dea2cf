"""Prefect artifact keys: one history per run directory.

The UI's Artifacts page groups artifacts by key and shows each key's latest version. With fixed keys (`run-summary`,
`failed-samples-b1`) the runs of several run directories on one server interleaved there, and a run directory with
no failures left another's failed-samples table as the latest. Each key ends in the run directory's name: the name a
shared store files the run under (`ArtifactStoreBlock`), the same on every host, where the full path is each host's
own working copy. A flow run's own Artifacts tab is unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path


def slug(text: str) -> str:
    """Prefect keys are lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def run_key(what: str, run_dir: Path | str) -> str:
    """`what` for the run directory `run_dir`: `run-summary-nightly-kimi` for `.../runs/nightly-kimi`."""
    return f"{what}-{slug(Path(run_dir).name) or 'run'}"

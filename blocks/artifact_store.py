"""Where run directories live, as a Block: a path every worker mounts, or an fsspec URL (`s3://bucket/runs`)
mirrored part by part, so CPU workers and the GPU worker on different hosts share one run directory."""

from __future__ import annotations

import os
from pathlib import Path

from prefect.blocks.core import Block
from pydantic import Field

from tasks.common.artifact_store import RunStore

CACHE_ENV = "EAGLE3_DATAGEN_CACHE_DIR"


def local_cache_root(configured: str | None) -> Path:
    """The block's value, else this host's EAGLE3_DATAGEN_CACHE_DIR, else the user cache folder (not /tmp, which
    is cleared at boot and shared by every user of the host)."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "eagle3-datagen" / "runs"


def is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class ArtifactStoreBlock(Block):
    _block_type_slug = "eagle3-artifact-store"
    _block_type_name = "EAGLE-3 Artifact Store"
    _description = "Shared location of run directories: a mounted path or an fsspec URL (s3://, gs://, ...)."

    location: str = Field(description="Mounted path (/mnt/eagle3/runs) or fsspec URL (s3://bucket/eagle3/runs).")
    local_cache_dir: str | None = Field(
        default=None,
        description="Local working copy of run directories when location is a URL. Empty: each host's "
        f"${CACHE_ENV}, else ~/.cache/eagle3-datagen/runs (so every host can keep its own).",
    )

    def local_run_dir(self, run_name: str) -> Path:
        if not is_url(self.location):
            return Path(self.location.removeprefix("file://")) / run_name
        return local_cache_root(self.local_cache_dir) / run_name

    def run_store(self, run_name: str) -> RunStore | None:
        """None for a mounted path: the workers already share the files, nothing to mirror."""
        if not is_url(self.location):
            return None
        return RunStore(self.location, self.local_run_dir(run_name))

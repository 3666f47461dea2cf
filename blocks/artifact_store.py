"""Where run directories live, as a Block: a path every worker mounts, or an fsspec URL (`s3://bucket/runs`)
mirrored part by part, so CPU workers and the GPU worker on different hosts share one run directory."""

from __future__ import annotations

from pathlib import Path

from prefect.blocks.core import Block
from pydantic import Field

from tasks.common.artifact_store import RunStore


def is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


class ArtifactStoreBlock(Block):
    _block_type_slug = "eagle3-artifact-store"
    _block_type_name = "EAGLE-3 Artifact Store"
    _description = "Shared location of run directories: a mounted path or an fsspec URL (s3://, gs://, ...)."

    location: str = Field(description="Mounted path (/mnt/eagle3/runs) or fsspec URL (s3://bucket/eagle3/runs).")
    local_cache_dir: str = Field(
        default="/tmp/eagle3-runs", description="Local working copy of run directories when location is a URL."
    )

    def local_run_dir(self, run_name: str) -> Path:
        base = self.location.removeprefix("file://") if not is_url(self.location) else self.local_cache_dir
        return Path(base) / run_name

    def run_store(self, run_name: str) -> RunStore | None:
        """None for a mounted path: the workers already share the files, nothing to mirror."""
        if not is_url(self.location):
            return None
        return RunStore(self.location, self.local_run_dir(run_name))

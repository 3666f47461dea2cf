"""Run directories shared between hosts (CPU workers here, the GPU worker there) through any fsspec URL.

Stages always read and write a *local* run directory (atomic renames, memory-mapped safetensors); a RunStore
mirrors it to `<url>/<run name>`. A part is pushed data first and completion marker last, and pulled the same
way, so a host sees a part only once it is complete: the invariant of `tasks/common/shards.py`, carried across hosts.
A plain shared filesystem (NFS, a Docker volume) needs no store at all: point `run_dir` at it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq

from tasks.common.errors import ConfigError
from tasks.common.shards import PART_RE, PartRef


class RunStore:
    def __init__(self, url: str, local_run_dir: Path) -> None:
        self.url = url.rstrip("/")
        self.local_run_dir = local_run_dir
        fs, root = fsspec.core.url_to_fs(self.url)
        self.fs: Any = fs
        self.root = f"{root.rstrip('/')}/{local_run_dir.name}"

    def _remote(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def push_file(self, path: Path) -> None:
        """Upload under a temporary name, then move: an interrupted upload never shows under the final name."""
        rel = path.relative_to(self.local_run_dir).as_posix()
        remote = self._remote(rel)
        tmp = f"{remote}.uploading-{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(self._remote(str(Path(rel).parent.as_posix())), exist_ok=True)
        self.fs.put_file(str(path), tmp)
        self.fs.mv(tmp, remote)

    def push_part(self, ref: PartRef) -> int:
        """Push a finished part with the data files it references, marker last. Returns files pushed."""
        if not ref.is_done():
            raise ConfigError(f"cannot push {ref}: it has no completion marker")
        files = [*self._data_files(ref), ref.path]
        for path in files:
            self.push_file(path)
        self.push_file(ref.marker)
        return len(files) + 1

    def _data_files(self, ref: PartRef) -> list[Path]:
        if ref.stage != "hidden_states":
            return []
        shards = sorted(set(pq.read_table(ref.path, columns=["shard"])["shard"].to_pylist()))
        return [ref.run_dir / "hidden_states" / s for s in shards]

    def remote_parts(self, stage: str) -> list[int]:
        self.fs.invalidate_cache()  # object stores cache listings; another host may have pushed since
        pattern = self._remote(f"{stage}/_done/part-*.json")
        names = [Path(p).name.replace(".json", ".parquet") for p in self.fs.glob(pattern)]
        return sorted(int(m.group(1)) for n in names if (m := PART_RE.match(n)))

    def pull_file(self, rel: str) -> Path:
        local = self.local_run_dir / rel
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.tmp")
        self.fs.get_file(self._remote(rel), str(tmp))
        tmp.replace(local)
        return local

    def pull_stage(self, stage: str, parts: Iterable[int] | None = None) -> list[int]:
        """Fetch the remote finished parts this host lacks or holds in another build (data files, then the marker).

        A local part counts as the same only when its marker is byte-identical to the remote one: a part rebuilt
        on another host (new inputs, new recipe) replaces the local copy, whose marker goes first."""
        wanted = set(parts) if parts is not None else None
        pulled = []
        for part in self.remote_parts(stage):
            if wanted is not None and part not in wanted:
                continue
            ref = PartRef(self.local_run_dir, stage, part)
            rel_marker = ref.marker.relative_to(self.local_run_dir).as_posix()
            if ref.is_done() and ref.marker.read_bytes() == self.fs.cat_file(self._remote(rel_marker)):
                continue
            ref.marker.unlink(missing_ok=True)
            rel_part = ref.path.relative_to(self.local_run_dir).as_posix()
            self.pull_file(rel_part)
            if stage == "hidden_states":
                for shard in self._data_files(ref):
                    self.pull_file(shard.relative_to(self.local_run_dir).as_posix())
            self.pull_file(rel_marker)
            pulled.append(part)
        return pulled

    def pull_optional(self, rel: str) -> Path | None:
        self.fs.invalidate_cache(self._remote(rel))
        return self.pull_file(rel) if self.fs.exists(self._remote(rel)) else None

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "local_run_dir": str(self.local_run_dir)}

    def __repr__(self) -> str:
        return f"RunStore({json.dumps(self.describe())})"

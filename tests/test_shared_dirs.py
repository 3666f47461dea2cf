"""Shared run directories: every file this package writes gets the mode the umask gives (not mkstemp's 0600),
and the artifact store's local copy goes where the block or the host says, not into the system temp folder."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from blocks.artifact_store import CACHE_ENV, ArtifactStoreBlock
from tasks.common.schemas import PROMPTS
from tasks.common.shards import PartRef, atomic_write_text, write_part


@pytest.fixture()
def group_umask() -> Iterator[int]:
    previous = os.umask(0o002)
    try:
        yield 0o002
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_honour_the_umask(tmp_path: Path, group_umask: int) -> None:
    atomic_write_text(tmp_path / "report.md", "# hi")
    ref = PartRef(tmp_path, "prompts", 0)
    row = {
        "sample_id": "s0",
        "dataset": "B1",
        "source_file": "f",
        "source_row": 0,
        "messages": [{"role": "user", "content": "hi"}],
        "prompt_id": "s0",
        "sample_index": 0,
    }
    write_part(ref, pa.Table.from_pylist([row], schema=PROMPTS), {})
    for path in (tmp_path / "report.md", ref.path, ref.marker):
        assert _mode(path) == 0o666 & ~group_umask, (path, oct(_mode(path)))
    os.umask(0o077)
    atomic_write_text(tmp_path / "private.md", "# mine")
    assert _mode(tmp_path / "private.md") == 0o600


def test_the_local_cache_comes_from_the_block_then_the_host_then_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    remote = ArtifactStoreBlock(location="s3://bucket/eagle3")
    assert remote.local_run_dir("r1") == tmp_path / "xdg" / "eagle3-datagen" / "runs" / "r1"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "host-cache"))
    assert remote.local_run_dir("r1") == tmp_path / "host-cache" / "r1"
    pinned = ArtifactStoreBlock(location="s3://bucket/eagle3", local_cache_dir=str(tmp_path / "pinned"))
    assert pinned.local_run_dir("r1") == tmp_path / "pinned" / "r1"
    assert ArtifactStoreBlock(location=str(tmp_path / "nfs")).local_run_dir("r1") == tmp_path / "nfs" / "r1"

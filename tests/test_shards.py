from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.common.errors import SchemaMismatchError
from tasks.common.schemas import PROMPTS
from tasks.common.shards import META_VERSION, PartRef, done_parts, read_part, read_provenance, write_part

ROW = {
    "sample_id": "a",
    "dataset": "B1",
    "source_file": "f",
    "source_row": 0,
    "messages": [{"role": "user", "content": "hi"}],
    "prompt_id": "a",
    "sample_index": 0,
}


def test_part_is_done_only_with_marker_and_carries_provenance(tmp_path: Path) -> None:
    ref = PartRef(tmp_path, "prompts", 3)
    write_part(ref, pa.Table.from_pylist([ROW], schema=PROMPTS), {"model": "m", "endpoint": "e"}, {"n": 1})
    assert ref.is_done()
    assert read_part(ref).to_pylist() == [ROW]
    assert read_provenance(ref.path) == {"model": "m", "endpoint": "e"}
    assert json.loads(ref.marker.read_text())["rows"] == 1
    ref.marker.unlink()
    assert done_parts(tmp_path, "prompts") == []
    with pytest.raises(FileNotFoundError):
        read_part(ref)


def test_no_temporary_files_left_and_missing_columns_refused(tmp_path: Path) -> None:
    ref = PartRef(tmp_path, "prompts", 0)
    with pytest.raises(SchemaMismatchError, match="missing columns"):
        write_part(ref, pa.Table.from_pylist([{"sample_id": "a"}]), {})
    assert not ref.path.exists()
    write_part(ref, pa.Table.from_pylist([ROW], schema=PROMPTS), {})
    assert sorted(p.name for p in (tmp_path / "prompts").iterdir()) == ["_done", "part-00000.parquet"]


def test_reader_refuses_another_schema_version(tmp_path: Path) -> None:
    ref = PartRef(tmp_path, "prompts", 0)
    write_part(ref, pa.Table.from_pylist([ROW], schema=PROMPTS), {})
    table = pq.read_table(ref.path)
    meta = dict(table.schema.metadata or {})
    meta[META_VERSION] = b"999"
    pq.write_table(table.replace_schema_metadata(meta), ref.path)
    with pytest.raises(SchemaMismatchError, match="schema_version 999"):
        read_part(ref)

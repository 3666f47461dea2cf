"""The folder `datasets.Dataset.save_to_disk` writes, produced with pyarrow alone.

`datasets` is not a dependency of this project (its pins conflict with the trainers' own), so this writes the
same three kinds of file that `datasets` 4.x/5.x writes and `datasets.load_from_disk` reads (checked against
datasets 5.1.0's output, and read back by it in tests/test_export_trainers.py):

- data files (`save_to_disk` names them `data-KKKKK-of-NNNNN.arrow`; `load_from_disk` reads whatever names
  `state.json` lists, in that order): Arrow IPC *stream* format, schema metadata `huggingface` = {"info": {"features"}};
- `dataset_info.json`: citation, description, features, homepage, license;
- `state.json`: the data file list, a fingerprint, and the output format (`torch`, as speculators' own
  preprocessing leaves it, so rows come back as tensors).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from tasks.common.shards import atomic_write_bytes, atomic_write_text

FEATURE_TYPES: dict[pa.DataType, dict[str, Any]] = {
    pa.int64(): {"dtype": "int64", "_type": "Value"},
    pa.int32(): {"dtype": "int32", "_type": "Value"},
    pa.string(): {"dtype": "string", "_type": "Value"},
}


def feature_of(dtype: pa.DataType) -> dict[str, Any]:
    """A column's `datasets` feature description (Value, or List of Value as datasets >= 4 spells it)."""
    if pa.types.is_list(dtype):
        return {"feature": feature_of(dtype.value_type), "_type": "List"}
    if dtype in FEATURE_TYPES:
        return dict(FEATURE_TYPES[dtype])
    raise ValueError(f"no datasets feature mapping for arrow type {dtype}")


def features_of(schema: pa.Schema) -> dict[str, Any]:
    return {field.name: feature_of(field.type) for field in schema}


def write_data_file(path: Path, table: pa.Table) -> int:
    """One Arrow stream file, with the `huggingface` schema metadata, written atomically; returns its size."""
    info = {"info": {"features": features_of(table.schema)}}
    table = table.replace_schema_metadata({"huggingface": json.dumps(info)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    atomic_write_bytes(path, data)
    return len(data)


def write_dataset_metadata(directory: Path, schema: pa.Schema, data_files: Sequence[str], format_type: str) -> None:
    """`dataset_info.json` and `state.json`, after every data file is in place."""
    info = {"citation": "", "description": "", "features": features_of(schema), "homepage": "", "license": ""}
    fingerprint = hashlib.sha256(json.dumps([list(data_files), info], sort_keys=True).encode()).hexdigest()[:16]
    state: dict[str, Any] = {
        "_data_files": [{"filename": name} for name in data_files],
        "_fingerprint": fingerprint,
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": format_type,
        "_output_all_columns": False,
        "_split": None,
    }
    atomic_write_text(directory / "dataset_info.json", json.dumps(info, indent=2))
    atomic_write_text(directory / "state.json", json.dumps(state, indent=2))

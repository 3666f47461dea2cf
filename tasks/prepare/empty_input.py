"""An input that yields no prompt is the user's mistake (wrong file, wrong `shape`), not a successful empty run:
every configured dataset must contribute at least one prompt, or the run stops before anything is sent."""

from __future__ import annotations

from typing import Any

from tasks.common.errors import EmptyInputError


def require_prompts(prepared: dict[str, Any], dataset_paths: dict[str, str] | None = None) -> None:
    """`prepared` is `PrepareResult.to_dict()`; raises EmptyInputError naming the first empty dataset."""
    for name, counts in prepared["datasets"].items():
        if counts["kept"]:
            continue
        where = f" ({dataset_paths[name]})" if dataset_paths and name in dataset_paths else ""
        if counts["quarantined"]:
            raise EmptyInputError(
                f"dataset {name}{where}: all {counts['quarantined']} rows were quarantined, none is usable; the "
                f"reasons are in {prepared['quarantine_path']} (check the file and datasets[].shape)"
            )
        raise EmptyInputError(f"dataset {name}{where} holds no rows: point datasets[].path at a non-empty file")

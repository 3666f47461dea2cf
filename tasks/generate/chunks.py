"""The on-disk layout of uncommitted generate work and the rule that merges it, shared by the engine (resume)
and the run-directory summary; kept free of heavy imports so a report never loads transformers.

Layout: <run_dir>/responses/_chunks/part-NNNNN/chunk-NNNNNN.parquet, written atomically in sequence. Chunks are
replayed in write order and later rows win, except that a "done" row is never replaced: once a sample has
been paid for and committed it is final.

<run_dir>/responses/_journal/journal-<token>.log holds every row of a run within its group-commit window
(`tasks.generate.journal` framing, records {"p": part, "r": row}); a journal file outlives only a killed run
(the folder stays, empty; a run compacts the journals it finds into chunks, and deletes its own once everything
is in chunks or parts).
Journal rows replay after the chunks: they are at least as new.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tasks.common.schemas import RESPONSES
from tasks.common.shards import check_schema, part_name
from tasks.generate.journal import read_records

STAGE = "responses"
CHUNKS_DIR = "_chunks"
JOURNAL_DIR = "_journal"


def journal_dir(run_dir: Path) -> Path:
    return run_dir / STAGE / JOURNAL_DIR


def journal_paths(run_dir: Path) -> list[Path]:
    folder = journal_dir(run_dir)
    return sorted(folder.glob("journal-*.log")) if folder.is_dir() else []


def journal_rows(run_dir: Path, paths: list[Path] | None = None) -> dict[int, list[dict[str, Any]]]:
    """Rows of the journals (all, or `paths`) by part, in write order; a torn tail record is skipped."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in journal_paths(run_dir) if paths is None else paths:
        for rec in read_records(path):
            out.setdefault(int(rec["p"]), []).append(rec["r"])
    return out


def chunk_dir(run_dir: Path, part: int) -> Path:
    return run_dir / STAGE / CHUNKS_DIR / part_name(part)


def chunk_index(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])


def chunk_paths(run_dir: Path, part: int) -> list[Path]:
    """Committed chunks in write order (by number, not by name)."""
    cdir = chunk_dir(run_dir, part)
    if not cdir.is_dir():
        return []
    return sorted(cdir.glob("chunk-*.parquet"), key=chunk_index)


def unfinished_chunk_rows(run_dir: Path, finished: set[int], columns: list[str]) -> Iterator[dict[str, Any]]:
    """The rows of the committed chunks of every responses part not in `finished`, part by part in write order
    (a later row of a sample replaces an earlier one): what a budget stop or a kill left of an unfinished part."""
    root = chunk_dir(run_dir, 0).parent
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        part = int(entry.name.split("-")[1]) if entry.name.startswith("part-") else None
        if part is None or part in finished:
            continue
        for path in chunk_paths(run_dir, part):
            yield from read_chunk(path, columns)


def unfinished_answer_rows(run_dir: Path, finished: set[int], columns: list[str]) -> list[dict[str, Any]]:
    """One row per sample (`merge_row`: a done row stays) of the committed chunks and the journal of the parts
    not in `finished` (`columns` only, which must include sample_id and status): a `kill -9` leaves its last
    answers in the journal alone, and the next run replays them instead of buying them again. The journal also
    holds the answers already committed to chunks, so rows are merged by sample, not chained (chained, the
    estimate's observed lengths counted 24 of 47 answers twice)."""
    latest: dict[str, dict[str, Any]] = {}
    for row in unfinished_chunk_rows(run_dir, finished, columns):
        merge_row(latest, row)
    for part, rows in journal_rows(run_dir).items():
        for row in rows if part not in finished else ():
            merge_row(latest, {c: row.get(c) for c in columns})
    return list(latest.values())


def read_chunk(path: Path, columns: list[str] | None = None) -> list[dict[str, Any]]:
    check_schema(path, RESPONSES, STAGE)
    rows: list[dict[str, Any]] = pq.read_table(path, columns=columns or list(RESPONSES.names)).to_pylist()
    return rows


def merge_row(rows: dict[str, dict[str, Any]], row: dict[str, Any]) -> None:
    existing = rows.get(row["sample_id"])
    if existing is None or existing["status"] != "done":
        rows[row["sample_id"]] = row

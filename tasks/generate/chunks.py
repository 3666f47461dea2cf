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


def part_answer_rows(
    run_dir: Path, part: int, columns: list[str], journaled: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """sample_id -> row (`columns` only, which include sample_id and status) of an unfinished part: its committed
    chunks, then its journaled rows (`journal_rows(run_dir)[part]`), merged by sample (`merge_row`: a done row
    stays). A `kill -9` leaves its last answers in the journal alone, and the journal also repeats answers already
    committed to chunks, so rows are merged, not chained (chained, the estimate counted 24 of 47 answers twice)."""
    rows: dict[str, dict[str, Any]] = {}
    for path in chunk_paths(run_dir, part):
        for row in read_chunk(path, columns):
            merge_row(rows, row)
    for row in journaled:
        merge_row(rows, {c: row.get(c) for c in columns})
    return rows


def unfinished_answer_rows(run_dir: Path, finished: set[int], columns: list[str]) -> list[dict[str, Any]]:
    """`part_answer_rows` of every responses part not in `finished` that has chunks or journaled rows: what a
    budget stop or a kill left of the parts it did not finish, and the next run keeps."""
    journaled = journal_rows(run_dir)
    root = chunk_dir(run_dir, 0).parent
    entries = sorted(root.iterdir()) if root.is_dir() else []
    chunked = {int(e.name.split("-")[1]) for e in entries if e.name.startswith("part-")}
    out: list[dict[str, Any]] = []
    for part in sorted((chunked | set(journaled)) - finished):
        out += part_answer_rows(run_dir, part, columns, journaled.get(part, [])).values()
    return out


def read_chunk(path: Path, columns: list[str] | None = None) -> list[dict[str, Any]]:
    check_schema(path, RESPONSES, STAGE)
    rows: list[dict[str, Any]] = pq.read_table(path, columns=columns or list(RESPONSES.names)).to_pylist()
    return rows


def merge_row(rows: dict[str, dict[str, Any]], row: dict[str, Any]) -> None:
    existing = rows.get(row["sample_id"])
    if existing is None or existing["status"] != "done":
        rows[row["sample_id"]] = row

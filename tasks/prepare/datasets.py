"""Prompt datasets (JSONL or Parquet; OpenAI `messages` or ShareGPT `conversations`) -> `prompts` parts.

Invariants: every input row ends up in exactly one place (a prompts row, the duplicate count, or the quarantine
file with its reason); parts hold one dataset each; a sample id is written to at most one part of a run
directory, ever, so reruns and dataset extensions append parts and never rewrite or duplicate.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.common.config import DatasetConfig, PipelineConfig
from tasks.common.errors import ConfigError, EmptyInputError, SchemaMismatchError
from tasks.common.messages import ROLES, Message, prompt_messages, response_sample_id, sample_id
from tasks.common.preflight import check_datasets
from tasks.common.schemas import PROMPTS
from tasks.common.shards import (
    PART_RE,
    PartRef,
    atomic_write_text,
    done_parts,
    part_intact,
    read_part,
    read_part_file,
    write_part,
)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MANIFEST = "_manifest.json"
QUARANTINE = "_quarantine.jsonl"
"""Beside the parts, with a leading underscore so that readers of the stage folder (`pq.read_table`) skip it."""


class MalformedRow(ValueError):
    pass


@dataclass
class DatasetCounts:
    rows_read: int = 0
    kept: int = 0
    duplicates: int = 0
    quarantined: int = 0
    empty_system_dropped: int = 0
    already_prepared: int = 0
    new: int = 0
    parts: list[int] = field(default_factory=list)


@dataclass
class PrepareResult:
    parts: list[int]
    datasets: dict[str, DatasetCounts]
    quarantine_path: Path
    reused: bool

    @property
    def quarantined(self) -> int:
        return sum(c.quarantined for c in self.datasets.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "parts": self.parts,
            "datasets": {k: asdict(v) for k, v in self.datasets.items()},
            "quarantine_path": str(self.quarantine_path),
            "quarantined": self.quarantined,
            "reused": self.reused,
        }


def _file_format(ds: DatasetConfig) -> str:
    if ds.file_format != "auto":
        return ds.file_format
    suffix = ds.path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ConfigError(f"dataset {ds.name}: cannot tell the format of {ds.path}; set file_format")


def _raw_rows(ds: DatasetConfig) -> Iterator[tuple[int, Any, str | None]]:
    """Yield (row number, parsed row or None, parse error) so a bad line is quarantined, not fatal."""
    if not ds.path.is_file():
        raise ConfigError(f"dataset {ds.name}: {ds.path} does not exist")
    if _file_format(ds) == "jsonl":
        with ds.path.open("rb") as fh:
            for i, raw in enumerate(fh):
                if i == 0:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:  # replaced, it would send and store text nobody wrote
                    bad = raw[exc.start : exc.start + 1].hex()
                    yield (
                        i,
                        raw.decode("utf-8", errors="replace")[:500],
                        f"not UTF-8: byte 0x{bad} at byte {exc.start + 1}",
                    )
                    continue
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line), None
                except json.JSONDecodeError as exc:
                    yield i, line[:500], f"bad JSON: {_json_error(exc)}"
    else:
        pf = pq.ParquetFile(ds.path)
        row = 0
        for batch in pf.iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                yield row, record, None
                row += 1


def _json_error(exc: json.JSONDecodeError) -> str:
    """Some of json's messages end in "at" ("Invalid control character at"), waiting for a position."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def normalize_row(row: Any, shape: str) -> list[Message]:
    return normalize_row_counting(row, shape)[0]


def normalize_row_counting(row: Any, shape: str) -> tuple[list[Message], int]:
    """The row's prompt, and how many empty system turns were left out of it.

    ShareGPT exports commonly carry `{"from": "system", "value": ""}` on every row: it says "no system prompt", so
    the turn is dropped (the endpoint is sent, and the ids are built from, the same messages) rather than the row
    quarantined. An empty user or assistant turn is still a malformed row."""
    if not isinstance(row, dict):
        raise MalformedRow(f"row is {type(row).__name__}, expected an object")
    if shape == "auto":
        if "messages" in row:
            shape = "messages"
        elif "conversations" in row:
            shape = "sharegpt"
        else:
            raise MalformedRow(f"row has neither 'messages' nor 'conversations' (keys: {sorted(row)[:8]})")
    if shape == "messages":
        turns, role_key, content_key, roles = row.get("messages"), "role", "content", {r: r for r in ROLES}
    else:
        turns, role_key, content_key, roles = row.get("conversations"), "from", "value", SHAREGPT_ROLES
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as exc:
            raise MalformedRow(f"{shape} field is a string that is not JSON: {_json_error(exc)}") from exc
    if not isinstance(turns, list):
        raise MalformedRow(f"{shape} must be a non-empty list, got {type(turns).__name__}")
    if not turns:
        raise MalformedRow(f"{shape} must be a non-empty list, got an empty one")
    messages: list[Message] = []
    empty_system = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise MalformedRow(f"turn {i} is {type(turn).__name__}, expected an object")
        role = turn.get(role_key)
        if role is None:
            raise MalformedRow(f"turn {i} has no '{role_key}'")
        if not isinstance(role, str) or role not in roles:
            raise MalformedRow(f"turn {i} has unknown role {role!r}")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise MalformedRow(f"turn {i} content is {type(content).__name__}, expected a string")
        if not content.strip():
            if roles[role] == "system":
                empty_system += 1
                continue
            raise MalformedRow(f"turn {i} ({roles[role]}) has empty content")
        messages.append(Message(role=roles[role], content=content))
    prompt = prompt_messages(messages)
    if not prompt or prompt[-1]["role"] != "user":
        raise MalformedRow("conversation has no user turn to answer (after dropping trailing assistant turns)")
    return prompt, empty_system


def _fingerprint(cfg: PipelineConfig) -> dict[str, Any]:
    """Inputs that decide the prompts parts: unchanged inputs let a rerun skip reading the datasets at all."""
    files = {}
    for ds in cfg.datasets:
        digest = hashlib.sha256()
        with ds.path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        files[ds.name] = {
            "path": str(ds.path),
            "sha256": digest.hexdigest(),
            "shape": ds.shape,
            "max_samples": ds.max_samples,
        }
    return {
        "datasets": files,
        "samples_per_shard": cfg.samples_per_shard,
        "samples_per_prompt": cfg.sampling.samples_per_prompt,
    }


def restore_unmarked_parts(cfg: PipelineConfig) -> list[int]:
    """Prompts parts on disk without their marker, marked again where they read whole; removed where they do not
    (their numbers are returned, for `_existing_samples` to fill again).

    A part whose marker is gone (deleted by hand, or a crash between the part's rename and its marker) was
    otherwise invisible to `_existing_samples`: its samples were prepared a second time into a new part, bought
    again by generate and present twice in every later stage and in the export. Re-marking keeps the part's rows
    and number (same rows, same fingerprint: nothing downstream goes stale)."""
    removed: list[int] = []
    stage_dir = cfg.run_dir / "prompts"
    if not stage_dir.is_dir():
        return removed
    for entry in sorted(stage_dir.iterdir()):
        m = PART_RE.match(entry.name)
        ref = PartRef(cfg.run_dir, "prompts", int(m.group(1))) if m else None
        if ref is None or ref.marker.exists():
            continue
        try:
            table = read_part_file(ref)
        except SchemaMismatchError:
            table = None
        if table is None or table.num_rows == 0:
            ref.path.unlink(missing_ok=True)
            removed.append(ref.part)
            continue
        dataset = table["dataset"][0].as_py()
        write_part(ref, table.select(PROMPTS.names), cfg.provenance() | {"dataset": dataset}, {"dataset": dataset})
    return removed


def _existing_samples(cfg: PipelineConfig) -> tuple[set[str], dict[str, list[int]], int, list[int]]:
    """Sample ids already prepared, parts per dataset, the next free part number, and the numbers of finished
    parts whose file is gone or damaged (`part_intact`): their marker and file are removed and the samples they
    held, prepared again from the dataset in the same order, fill those numbers first. The responses and later
    parts of that number still hold those samples, so nothing is bought twice or duplicated (a new number would
    have done both)."""
    refill = restore_unmarked_parts(cfg)
    ids: set[str] = set()
    parts: dict[str, list[int]] = {}
    next_part = max(refill, default=-1) + 1
    done_dir = cfg.run_dir / "prompts" / "_done"
    for marker in sorted(done_dir.glob("part-*.json")) if done_dir.is_dir() else []:
        ref = PartRef(cfg.run_dir, "prompts", int(marker.stem.split("-")[1]))
        next_part = max(next_part, ref.part + 1)
        if not (ref.path.exists() and part_intact(ref)):
            ref.marker.unlink()
            ref.path.unlink(missing_ok=True)
            refill.append(ref.part)
            continue
        table = read_part(ref, columns=["sample_id", "dataset"])
        ids.update(table["sample_id"].to_pylist())
        if table.num_rows:
            parts.setdefault(table["dataset"][0].as_py(), []).append(ref.part)
    return ids, parts, next_part, sorted(refill)


def prepare_datasets(cfg: PipelineConfig) -> PrepareResult:
    """Write parts for samples not prepared yet; existing parts are never rewritten.

    Rerunning on unchanged inputs is a no-op; rerunning after a dataset grew (a nightly "extend" run) appends
    parts holding only the new samples, so everything downstream of the old parts stays valid. A dataset with
    no valid row is an `EmptyInputError` (after the quarantine file, which says why, is written).
    """
    check_datasets(cfg)
    stage_dir = cfg.run_dir / "prompts"
    manifest_path = stage_dir / MANIFEST
    fingerprint = _fingerprint(cfg)
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        done = {r.part for r in done_parts(cfg.run_dir, "prompts") if part_intact(r)}
        if manifest["fingerprint"] == fingerprint and set(manifest["parts"]) <= done:
            reused = {k: DatasetCounts(**v) for k, v in manifest["datasets"].items()}
            return PrepareResult(manifest["parts"], reused, stage_dir / QUARANTINE, reused=True)

    existing, existing_parts, next_part, refill = _existing_samples(cfg)
    counts: dict[str, DatasetCounts] = {}
    quarantine: list[str] = []
    for ds in cfg.datasets:
        c = counts[ds.name] = DatasetCounts(parts=sorted(existing_parts.get(ds.name, [])))
        seen: set[str] = set()
        rows: list[dict[str, Any]] = []
        for row_no, raw, parse_error in _raw_rows(ds):
            if ds.max_samples is not None and c.kept >= ds.max_samples:
                break
            c.rows_read += 1
            try:
                if parse_error:
                    raise MalformedRow(parse_error)
                messages, empty_system = normalize_row_counting(raw, ds.shape)
            except MalformedRow as exc:
                c.quarantined += 1
                quarantine.append(
                    json.dumps(
                        {
                            "dataset": ds.name,
                            "source_file": str(ds.path),
                            "source_row": row_no,
                            "reason": str(exc),
                            "raw": raw if isinstance(raw, str) else json.dumps(raw, default=str)[:2000],
                        },
                        ensure_ascii=False,
                    )
                )
                continue
            c.empty_system_dropped += empty_system
            sid = sample_id(ds.name, messages)
            if sid in seen:
                c.duplicates += 1
                continue
            seen.add(sid)
            c.kept += 1
            for k in range(cfg.sampling.samples_per_prompt):
                rid = response_sample_id(sid, k)
                if rid in existing:
                    c.already_prepared += 1
                    continue
                rows.append(
                    {
                        "sample_id": rid,
                        "dataset": ds.name,
                        "source_file": str(ds.path),
                        "source_row": row_no,
                        "messages": messages,
                        "prompt_id": sid,
                        "sample_index": k,
                    }
                )
        c.new = len(rows)
        for start in range(0, len(rows), cfg.samples_per_shard):
            chunk = rows[start : start + cfg.samples_per_shard]
            if refill:
                number = refill.pop(0)
            else:
                number, next_part = next_part, next_part + 1
            ref = PartRef(cfg.run_dir, "prompts", number)
            table = pa.Table.from_pylist(chunk, schema=PROMPTS)
            write_part(ref, table, cfg.provenance() | {"dataset": ds.name}, {"dataset": ds.name})
            c.parts.append(number)

    all_parts = sorted(p for c in counts.values() for p in c.parts)
    atomic_write_text(stage_dir / QUARANTINE, "".join(line + "\n" for line in quarantine))
    empty = [ds for ds in cfg.datasets if counts[ds.name].kept == 0]
    if empty:
        ds, c = empty[0], counts[empty[0].name]
        if c.rows_read == 0:
            raise EmptyInputError(
                f"dataset {ds.name}: {ds.path} holds no rows; point datasets[].path at a non-empty file"
            )
        raise EmptyInputError(
            f"dataset {ds.name}: no valid rows in {ds.path} ({c.rows_read} rows read, {c.quarantined} quarantined; "
            f"reasons in {stage_dir / QUARANTINE}); check the file and datasets[].shape"
        )
    manifest = {
        "fingerprint": fingerprint,
        "parts": all_parts,
        "datasets": {k: asdict(v) for k, v in counts.items()},
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    return PrepareResult(all_parts, counts, stage_dir / QUARANTINE, reused=False)

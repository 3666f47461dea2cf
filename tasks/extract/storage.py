"""Hidden states on disk: bounded safetensors shards of token-concatenated samples, indexed by a Parquet part.

Layout: `<run_dir>/hidden_states/_data/part-NNNNN-SSSS.safetensors` holds `input_ids` [T_total] (int32),
`aux_hidden_states` [T_total, 3H] and, unless the run stores aux states only, `hidden_states` [T_total, H]: the
final hidden state *before* the model's final norm (`FINAL_STATE`, declared in every shard's header), from which
both trainers' targets are exact (speculators applies the norm itself; the SpecForge export applies it);
the index part `hidden_states/part-NNNNN.parquet` maps each sample to (shard, token offset, length). Shards are
renamed into place complete, and the index part plus its marker are written last, so a crash leaves at most
unindexed shards that the next attempt deletes and rewrites.

Which sample goes to which shard, and at which row, is planned before the model runs (`plan_shards`): the
header of a safetensors file states every tensor's byte range, so knowing each shard's token count up front
lets the writer put each batch's rows straight at their final offsets (`writer.py`) instead of buffering a
whole shard and concatenating it. Every sample is checked before its bytes are written: a mismatched or
non-finite capture never reaches disk, where it would silently train a drafter on states that do not belong
to its tokens.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tasks.common.errors import CaptureMismatchError, CorruptPartError, InsufficientSpaceError, SchemaMismatchError
from tasks.common.shards import part_name

HIDDEN_DIR = "hidden_states"
DATA_DIR = "_data"
"""Shards sit under a leading-underscore folder so that `pq.read_table(run_dir / "hidden_states")` reads the index
parts only; index rows name their shard by path, so run directories written with `data/` still read."""
AUX_KEY = "aux_hidden_states"
FINAL_KEY = "hidden_states"
IDS_KEY = "input_ids"
IDS_DTYPE = torch.int32
FINAL_STATE = "pre_norm"
"""What `hidden_states` holds: the input of the target's final norm (vLLM's `hidden_states + residual` before
`self.norm`), not its output. Shards written before this was recorded stored the post-norm state; readers
refuse them (`check_shard_meaning`) rather than mix the two meanings."""
FINAL_STATE_META = "final_state"
NO_FINAL_STATE = "none"
HEADER_ALIGN = 8
"""The safetensors writer pads its JSON header with spaces to this multiple, so tensor data stays aligned."""

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int32: "I32",
}

FreeSpaceProbe = Callable[[Path], int]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported hidden-state dtype {dtype}")


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def estimate_bytes(n_tokens: int, hidden: int, dtype: str | torch.dtype, *, store_final_state: bool = True) -> int:
    """Tensor bytes for n_tokens: (3 aux + 1 final) x H values per token, or 3 x H when only aux is stored."""
    return n_tokens * (3 + int(store_final_state)) * hidden * _torch_dtype(dtype).itemsize


def disk_free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def ensure_space(directory: Path, needed: int, what: str, free_bytes: FreeSpaceProbe = disk_free_bytes) -> None:
    free = free_bytes(directory)
    if free < needed:
        raise InsufficientSpaceError(f"{what} needs ~{needed} bytes but {directory} has {free} bytes free")


def shard_name(part: int, shard: int) -> str:
    """Relative to `<run_dir>/hidden_states/`, as stored in the index's `shard` column."""
    return f"{DATA_DIR}/{part_name(part)}-{shard:04d}.safetensors"


def clear_stale_shards(run_dir: Path, part: int) -> int:
    """Remove the data shards (and temp files) an unfinished attempt at this part left; returns the count."""
    data_dir = run_dir / HIDDEN_DIR / DATA_DIR
    if not data_dir.is_dir():
        return 0
    pattern = re.compile(rf"^\.?{part_name(part)}-\d{{4}}\.safetensors(\..*\.tmp)?$")
    removed = 0
    for entry in data_dir.iterdir():
        if pattern.match(entry.name):
            entry.unlink()
            removed += 1
    return removed


@dataclass(frozen=True)
class StateLayout:
    """What one token's stored states look like: `n_aux` layers of width H, plus the final state or not."""

    layers: tuple[int, ...]
    hidden_size: int
    dtype: torch.dtype
    store_final_state: bool = True

    @property
    def n_aux(self) -> int:
        return len(self.layers)

    @property
    def aux_width(self) -> int:
        return self.n_aux * self.hidden_size

    def token_bytes(self) -> int:
        """On-disk bytes per token, int32 input id included."""
        widths = self.aux_width + (self.hidden_size if self.store_final_state else 0)
        return widths * self.dtype.itemsize + IDS_DTYPE.itemsize


def check_capture(
    sample_id: str,
    n_input_ids: int,
    aux: torch.Tensor,
    final: torch.Tensor | None,
    layout: StateLayout,
    *,
    nonfinite_rows: torch.Tensor | None = None,
) -> None:
    """Raise CaptureMismatchError unless aux is [T, n_aux*H], final is [T, H] (or absent when the layout stores
    aux only), both of the layout's dtype, and every value finite.

    `nonfinite_rows` ([T] bool), when given, is a per-token flag computed where the tensors were produced
    (on the GPU, before the copy to host), so the finiteness check need not read every byte again on the CPU.
    """
    expected: list[tuple[str, torch.Tensor | None, int]] = [(AUX_KEY, aux, layout.aux_width)]
    if layout.store_final_state:
        expected.append((FINAL_KEY, final, layout.hidden_size))
    elif final is not None:
        raise CaptureMismatchError(sample_id, f"{FINAL_KEY} presence", "absent (aux-only layout)", "present")
    for key, tensor, width in expected:
        if tensor is None:
            raise CaptureMismatchError(sample_id, f"{key} presence", "a tensor", "none")
        if tensor.ndim != 2:
            raise CaptureMismatchError(sample_id, f"{key} rank", 2, tensor.ndim)
        if tensor.shape[0] != n_input_ids:
            raise CaptureMismatchError(sample_id, f"{key} length vs len(input_ids)", n_input_ids, tensor.shape[0])
        if tensor.shape[1] != width:
            raise CaptureMismatchError(sample_id, f"{key} width", width, tensor.shape[1])
        if tensor.dtype != layout.dtype:
            raise CaptureMismatchError(sample_id, f"{key} dtype", layout.dtype, tensor.dtype)
    if nonfinite_rows is None:
        tensors = [t for _, t, _ in expected if t is not None]
        nonfinite_rows = torch.zeros(n_input_ids, dtype=torch.bool)
        for tensor in tensors:
            nonfinite_rows |= ~torch.isfinite(tensor).all(dim=1)
    if bool(nonfinite_rows.any()):
        first = int(nonfinite_rows.nonzero()[0, 0])
        raise CaptureMismatchError(
            sample_id,
            "hidden state values",
            "all finite",
            f"NaN/Inf in {int(nonfinite_rows.sum())} tokens, first at token {first}",
        )


@dataclass(frozen=True)
class ShardSpec:
    """One planned shard: its name, token and sample counts, its header bytes, the absolute byte offset of each
    tensor's data in the file, and the file's final size."""

    name: str
    tokens: int
    samples: int
    header: bytes
    data_start: dict[str, int]
    size: int


@dataclass(frozen=True)
class SamplePlacement:
    shard: int
    offset: int


@dataclass(frozen=True)
class ShardPlan:
    """Where every sample of a part goes: `placements[i]` for sample i of the part, shards in file order."""

    shards: list[ShardSpec]
    placements: list[SamplePlacement]
    oversize_shards: int

    def members(self, shard: int) -> list[int]:
        return [i for i, p in enumerate(self.placements) if p.shard == shard]


def safetensors_header(
    tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[bytes, dict[str, int]]:
    """The 8-byte length prefix plus JSON header of a safetensors file whose tensors follow in the given order,
    and each tensor's absolute byte offset in the file. Matches what `safetensors.torch.save_file` writes."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    relative: dict[str, int] = {}
    cursor = 0
    for key, dtype, shape in tensors:
        n_bytes = dtype.itemsize
        for dim in shape:
            n_bytes *= dim
        entries[key] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [cursor, cursor + n_bytes],
        }
        relative[key] = cursor
        cursor += n_bytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % HEADER_ALIGN)
    header = struct.pack("<Q", len(body)) + body
    return header, {key: len(header) + off for key, off in relative.items()}


def shard_tensors(tokens: int, layout: StateLayout) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        (IDS_KEY, IDS_DTYPE, (tokens,)),
        (AUX_KEY, layout.dtype, (tokens, layout.aux_width)),
    ]
    if layout.store_final_state:
        tensors.append((FINAL_KEY, layout.dtype, (tokens, layout.hidden_size)))
    return tensors


def _shard_spec(part: int, index: int, tokens: int, samples: int, layout: StateLayout) -> ShardSpec:
    metadata = {
        "format": "pt",
        "layers": json.dumps(list(layout.layers)),
        "hidden_size": str(layout.hidden_size),
        "samples": str(samples),
        "store_final_state": json.dumps(layout.store_final_state),
        FINAL_STATE_META: FINAL_STATE if layout.store_final_state else NO_FINAL_STATE,
    }
    tensors = shard_tensors(tokens, layout)
    header, starts = safetensors_header(tensors, metadata)
    key, dtype, shape = tensors[-1]
    end = starts[key] + dtype.itemsize * shape[0] * (shape[1] if len(shape) > 1 else 1)
    return ShardSpec(shard_name(part, index), tokens, samples, header, starts, end)


HEADER_RESERVE_BYTES = 1024
"""Upper bound on a shard's safetensors header (3 tensor entries + small metadata), counted in the budget."""


def plan_shards(
    part: int, order: Sequence[int], lengths: Sequence[int], layout: StateLayout, max_shard_bytes: int
) -> ShardPlan:
    """Assign samples, in the order the model will produce them, to consecutive shards of at most
    `max_shard_bytes` each. A sample larger than the budget gets a shard of its own (samples are never split,
    so a reader needs one slice per tensor); `oversize_shards` counts those. Empty parts have no shards."""
    if sorted(order) != list(range(len(lengths))):
        raise ValueError(f"processing order must be a permutation of the {len(lengths)} samples")
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = HEADER_RESERVE_BYTES
    for i in order:
        size = lengths[i] * layout.token_bytes()
        if current and current_bytes + size > max_shard_bytes:
            groups.append(current)
            current, current_bytes = [], HEADER_RESERVE_BYTES
        current.append(i)
        current_bytes += size
    if current:
        groups.append(current)
    placements: list[SamplePlacement | None] = [None] * len(lengths)
    shards = []
    oversize = 0
    for s, group in enumerate(groups):
        offset = 0
        for i in group:
            placements[i] = SamplePlacement(s, offset)
            offset += lengths[i]
        spec = _shard_spec(part, s, offset, len(group), layout)
        oversize += spec.size > max_shard_bytes
        shards.append(spec)
    return ShardPlan(shards, [p for p in placements if p is not None], oversize)


def check_shard_meaning(path: Path, metadata: Mapping[str, str] | None, has_final: bool) -> None:
    """Refuse a shard whose final state is not `FINAL_STATE` (older extracts stored the post-norm state, which
    the speculators trainer would normalize a second time). Aux-only shards carry no final state to misread."""
    if not has_final:
        return
    found = (metadata or {}).get(FINAL_STATE_META)
    if found != FINAL_STATE:
        raise SchemaMismatchError(
            f"{path}: final hidden state is {found or 'post_norm (written before the meaning was recorded)'}, "
            f"this code reads {FINAL_STATE}; re-run extract, which redoes such parts"
        )


def open_shard(path: Path) -> Any:
    """`safe_open` of a hidden-states shard; one cut short or overwritten is a typed error naming the shard and
    the part to rebuild, not an internal error out of the reader (`SafetensorError: ... incomplete metadata`)."""
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        part = path.name.rsplit("-", 1)[0]
        raise CorruptPartError(
            f"{path} is not a readable hidden-states shard ({exc}; {path.stat().st_size:,} bytes on disk): delete "
            f"{path.parent.parent / '_done' / (part + '.json')} and rerun extract to rebuild {part}"
        ) from exc


def marker_is_current(stats: Mapping[str, Any]) -> bool:
    """A finished part's marker stats describe states this code reads: aux-only, or the `FINAL_STATE` final state.
    The extract stage redoes a part whose marker fails this instead of skipping it."""
    return not stats.get("store_final_state", True) or stats.get(FINAL_STATE_META) == FINAL_STATE


def load_hidden_states(
    run_dir: Path, index_row: Mapping[str, Any], *, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids [T] int32, aux [T, 3H], final [T, H] pre-norm or None for aux-only runs) of one index row,
    reading only its slice of the shard. A shard that does not declare the pre-norm final state is refused.

    `verify` re-runs the write-time checks (shape, dtype, finite) so a corrupted or mismatched shard fails
    here, naming the sample, rather than inside a training step.
    """
    sample_id = str(index_row["sample_id"])
    offset = int(index_row["offset"])
    length = int(index_row["length"])
    path = Path(run_dir) / HIDDEN_DIR / str(index_row["shard"])
    with open_shard(path) as fh:
        keys = set(fh.keys())
        check_shard_meaning(path, fh.metadata(), FINAL_KEY in keys)
        ids = fh.get_slice(IDS_KEY)[offset : offset + length]
        aux = fh.get_slice(AUX_KEY)[offset : offset + length]
        final = fh.get_slice(FINAL_KEY)[offset : offset + length] if FINAL_KEY in keys else None
    if ids.shape[0] != length:
        raise CaptureMismatchError(sample_id, f"{IDS_KEY} slice length in {path.name}", length, ids.shape[0])
    if verify:
        layout = StateLayout(
            tuple(index_row["layers"]),
            int(index_row["hidden_size"]),
            DTYPES[str(index_row["dtype"])],
            store_final_state=final is not None,
        )
        check_capture(sample_id, length, aux, final, layout)
    return ids, aux, final

"""Hidden states on disk: bounded safetensors shards of token-concatenated samples, indexed by a Parquet part.

Layout: `<run_dir>/hidden_states/data/part-NNNNN-SSSS.safetensors` holds `aux_hidden_states` [T_total, 3H],
`hidden_states` [T_total, H] and `input_ids` [T_total] (int32); the index part
`hidden_states/part-NNNNN.parquet` maps each sample to (shard, token offset, length). Shards are renamed into
place complete, and the index part plus its marker are written last, so a crash leaves at most unindexed
shards that the next attempt overwrites. Every sample is checked before it is buffered: a mismatched or
non-finite capture never reaches disk, where it would silently train a drafter on states that do not belong to
its tokens.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tasks.errors import CaptureMismatchError, InsufficientSpaceError
from tasks.shards import part_name

HIDDEN_DIR = "hidden_states"
DATA_DIR = "data"
AUX_KEY = "aux_hidden_states"
FINAL_KEY = "hidden_states"
IDS_KEY = "input_ids"
HEADER_RESERVE_BYTES = 1024
"""Upper bound on a shard's safetensors header (3 tensor entries + small metadata), counted in the budget."""

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

FreeSpaceProbe = Callable[[Path], int]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported hidden-state dtype {dtype}")


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def estimate_bytes(n_tokens: int, hidden: int, dtype: str | torch.dtype) -> int:
    """Tensor bytes for n_tokens: (3 aux + 1 final) x H values per token."""
    return n_tokens * (3 + 1) * hidden * _torch_dtype(dtype).itemsize


def sample_bytes(n_tokens: int, hidden: int, n_layers: int, dtype: torch.dtype) -> int:
    """Exact on-disk tensor bytes of one sample, int32 input ids included."""
    return n_tokens * ((n_layers + 1) * hidden * dtype.itemsize + 4)


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


def check_capture(
    sample_id: str,
    n_input_ids: int,
    aux: torch.Tensor,
    final: torch.Tensor,
    *,
    n_layers: int,
    hidden_size: int,
    dtype: torch.dtype,
) -> None:
    """Raise CaptureMismatchError unless aux is [T, n_layers*H], final is [T, H], both `dtype` and finite."""
    for key, tensor, width in ((AUX_KEY, aux, n_layers * hidden_size), (FINAL_KEY, final, hidden_size)):
        if tensor.ndim != 2:
            raise CaptureMismatchError(sample_id, f"{key} rank", 2, tensor.ndim)
        if tensor.shape[0] != n_input_ids:
            raise CaptureMismatchError(sample_id, f"{key} length vs len(input_ids)", n_input_ids, tensor.shape[0])
        if tensor.shape[1] != width:
            raise CaptureMismatchError(sample_id, f"{key} width", width, tensor.shape[1])
        if tensor.dtype != dtype:
            raise CaptureMismatchError(sample_id, f"{key} dtype", dtype, tensor.dtype)
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            first = int(bad.any(dim=1).nonzero()[0, 0])
            raise CaptureMismatchError(
                sample_id,
                f"{key} values",
                "all finite",
                f"{int(bad.sum())} NaN/Inf values, first at token {first}",
            )


def save_safetensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write under a temp name in the same directory, fsync, rename; returns the file size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


@dataclass(frozen=True)
class ShardLocation:
    shard: str
    offset: int


class ShardWriter:
    """Buffers checked samples and writes a shard whenever the next sample would push it past max_shard_bytes.

    A single sample larger than the budget gets a shard of its own (samples are never split across shards, so
    a reader needs one slice per tensor); `oversize_shards` counts those.
    """

    def __init__(
        self,
        run_dir: Path,
        part: int,
        *,
        layers: list[int],
        hidden_size: int,
        dtype: torch.dtype,
        max_shard_bytes: int,
    ) -> None:
        self.run_dir = run_dir
        self.part = part
        self.layers = list(layers)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[str] = []
        self.bytes_written = 0
        self.oversize_shards = 0
        self._ids: list[torch.Tensor] = []
        self._aux: list[torch.Tensor] = []
        self._final: list[torch.Tensor] = []
        self._buffered_tokens = 0
        self._buffered_bytes = 0

    def add(self, sample_id: str, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> ShardLocation:
        check_capture(
            sample_id,
            int(input_ids.shape[0]),
            aux,
            final,
            n_layers=len(self.layers),
            hidden_size=self.hidden_size,
            dtype=self.dtype,
        )
        size = sample_bytes(int(input_ids.shape[0]), self.hidden_size, len(self.layers), self.dtype)
        if self._ids and HEADER_RESERVE_BYTES + self._buffered_bytes + size > self.max_shard_bytes:
            self.flush()
        location = ShardLocation(shard_name(self.part, len(self.shards)), self._buffered_tokens)
        self._ids.append(input_ids.to(torch.int32))
        self._aux.append(aux)
        self._final.append(final)
        self._buffered_tokens += int(input_ids.shape[0])
        self._buffered_bytes += size
        return location

    def flush(self) -> None:
        if not self._ids:
            return
        name = shard_name(self.part, len(self.shards))
        tensors = {
            IDS_KEY: torch.cat(self._ids).contiguous(),
            AUX_KEY: torch.cat(self._aux).contiguous(),
            FINAL_KEY: torch.cat(self._final).contiguous(),
        }
        metadata = {
            "format": "pt",
            "layers": json.dumps(self.layers),
            "hidden_size": str(self.hidden_size),
            "samples": str(len(self._ids)),
        }
        size = save_safetensors_atomic(self.run_dir / HIDDEN_DIR / name, tensors, metadata)
        if size > self.max_shard_bytes:
            self.oversize_shards += 1
        self.shards.append(name)
        self.bytes_written += size
        self._ids.clear()
        self._aux.clear()
        self._final.clear()
        self._buffered_tokens = 0
        self._buffered_bytes = 0


def load_hidden_states(
    run_dir: Path, index_row: Mapping[str, Any], *, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [T] int32, aux [T, 3H], final [T, H]) of one index row, reading only its slice of the shard.

    `verify` re-runs the write-time checks (shape, dtype, finite) so a corrupted or mismatched shard fails
    here, naming the sample, rather than inside a training step.
    """
    sample_id = str(index_row["sample_id"])
    offset = int(index_row["offset"])
    length = int(index_row["length"])
    hidden = int(index_row["hidden_size"])
    dtype = DTYPES[str(index_row["dtype"])]
    n_layers = len(index_row["layers"])
    path = Path(run_dir) / HIDDEN_DIR / str(index_row["shard"])
    with safe_open(str(path), framework="pt") as fh:
        ids = fh.get_slice(IDS_KEY)[offset : offset + length]
        aux = fh.get_slice(AUX_KEY)[offset : offset + length]
        final = fh.get_slice(FINAL_KEY)[offset : offset + length]
    if ids.shape[0] != length:
        raise CaptureMismatchError(sample_id, f"{IDS_KEY} slice length in {path.name}", length, ids.shape[0])
    if verify:
        check_capture(sample_id, length, aux, final, n_layers=n_layers, hidden_size=hidden, dtype=dtype)
    return ids, aux, final

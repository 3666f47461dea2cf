"""SpecForge's offline EAGLE-3 layout: one `torch.save`d dict per sample.

Read from SpecForge's source (sgl-project/SpecForge `scripts/prepare_hidden_states.py`, which writes it, and
`specforge/data/preprocessing.py` `OfflineEagle3Dataset` / `list_local_files` in specforge 0.2.0, which read
it): files `rows_{g}-{g + 2000}/data_{i}.ckpt` (i the global sample index, g = i rounded down to the group
size 2000), each holding

- `input_ids`: [L] int64, `loss_mask`: [L] int64 (the reader zeroes the last position itself),
- `hidden_state`: [1, L, H], the target's final post-norm state (the reader's `target`),
- `aux_hidden_state`: [1, L, 3H], low/mid/high layer outputs concatenated (the reader's `hidden_state`),

in the model dtype. The reader walks the directory for `*.ckpt`, sorts the paths and `torch.load`s each with
`mmap=True`, so every file must be a complete zip-format `torch.save`; files are written under a temporary
name and renamed.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from tasks.common.shards import atomic_write_bytes
from tasks.export.progress import PartSlot
from tasks.export.source import ExportSample, iter_samples

FILE_GROUP_SIZE = 2000
SUFFIX = ".ckpt"


def sample_path(out_dir: Path, index: int) -> Path:
    group = (index // FILE_GROUP_SIZE) * FILE_GROUP_SIZE
    return Path(out_dir) / f"rows_{group}-{group + FILE_GROUP_SIZE}" / f"data_{index}{SUFFIX}"


def sample_record(sample: ExportSample) -> dict[str, torch.Tensor]:
    return {
        "input_ids": sample.input_ids,
        "loss_mask": sample.loss_mask,
        "hidden_state": sample.final.unsqueeze(0).contiguous(),
        "aux_hidden_state": sample.aux.unsqueeze(0).contiguous(),
    }


def write_part(out_dir: Path, slot: PartSlot) -> int:
    written = 0
    for n, sample in enumerate(iter_samples(slot.part)):
        buffer = io.BytesIO()
        torch.save(sample_record(sample), buffer)
        data = buffer.getvalue()
        atomic_write_bytes(sample_path(out_dir, slot.start + n), data)
        written += len(data)
    return written


def remove_stale(out_dir: Path, total: int) -> int:
    """Delete sample files a previous, larger export left: SpecForge would train on every `*.ckpt` it finds."""
    expected = {sample_path(out_dir, i) for i in range(total)}
    removed = 0
    for path in Path(out_dir).glob(f"rows_*/data_*{SUFFIX}"):
        if path not in expected:
            path.unlink()
            removed += 1
    return removed

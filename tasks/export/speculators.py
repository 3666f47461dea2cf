"""speculators' offline layout (vllm-project/speculators 0.9.0, `speculators.train.data.ArrowDataset`).

Read from its source: `ArrowDataset(max_len, datapath)` calls `datasets.load_from_disk(datapath)` for rows
with `input_ids` [L], `loss_mask` [L] and `seq_len` (all int64, torch format, as its own preprocessing saves
them), and, through `hs_connectors.FileTransfer(datapath / "hidden_states")`, loads row i's states from
`hidden_states/hs_{i}.safetensors` holding

- `token_ids`: [L] int64, compared with the row's `input_ids` (a mismatch makes the sample unavailable),
- `hidden_states`: [L, n_layers, H]: the aux layers low, mid, high, then the final post-norm state last
  (`hidden_states[:, :-1]` becomes the drafter input, `hidden_states[:, -1]` the verifier's last state).

The dataset folder is written with pyarrow (`arrow_disk.py`), one Arrow file per source part.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import save

from tasks.common.shards import atomic_write_bytes
from tasks.export.arrow_disk import data_file_name, write_data_file, write_dataset_metadata
from tasks.export.progress import PartSlot
from tasks.export.source import ExportSample, iter_samples

HIDDEN_STATES_DIR = "hidden_states"
ROW_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int64())),
        pa.field("loss_mask", pa.list_(pa.int64())),
        pa.field("seq_len", pa.int64()),
    ]
)


def states_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / HIDDEN_STATES_DIR / f"hs_{index}.safetensors"


def stacked_states(sample: ExportSample) -> torch.Tensor:
    """[L, 3H] aux + [L, H] final -> [L, 4, H], aux layers first in their stored order, final last."""
    length, width = sample.final.shape
    aux = sample.aux.view(length, -1, width)
    return torch.cat([aux, sample.final.unsqueeze(1)], dim=1).contiguous()


def write_part(out_dir: Path, slot: PartSlot, n_parts: int) -> int:
    written = 0
    ids: list[list[int]] = []
    masks: list[list[int]] = []
    for n, sample in enumerate(iter_samples(slot.part)):
        data = save({"token_ids": sample.input_ids.contiguous(), "hidden_states": stacked_states(sample)})
        atomic_write_bytes(states_path(out_dir, slot.start + n), data)
        written += len(data)
        ids.append(sample.input_ids.tolist())
        masks.append(sample.loss_mask.tolist())
    table = pa.table({"input_ids": ids, "loss_mask": masks, "seq_len": [len(i) for i in ids]}, schema=ROW_SCHEMA)
    written += write_data_file(Path(out_dir) / data_file_name(slot.position, n_parts), table)
    return written


def finish(out_dir: Path, n_parts: int) -> None:
    write_dataset_metadata(Path(out_dir), ROW_SCHEMA, [data_file_name(k, n_parts) for k in range(n_parts)], "torch")


def remove_stale(out_dir: Path, total: int, n_parts: int) -> int:
    """Delete states and data files a previous export with more samples or parts left behind."""
    removed = 0
    for path in (Path(out_dir) / HIDDEN_STATES_DIR).glob("hs_*.safetensors"):
        index = path.name[len("hs_") : -len(".safetensors")]
        if not index.isdigit() or int(index) >= total:
            path.unlink()
            removed += 1
    expected = {data_file_name(k, n_parts) for k in range(n_parts)}
    for path in Path(out_dir).glob("data-*-of-*.arrow"):
        if path.name not in expected:
            path.unlink()
            removed += 1
    return removed

"""speculators' offline layout (vllm-project/speculators 0.9.0, `speculators.train.data.ArrowDataset`).

Read from its source: `ArrowDataset(max_len, datapath, train_ratio=..., split=...)` calls
`datasets.load_from_disk(datapath)` for rows with `input_ids` [L], `loss_mask` [L] and `seq_len` (all int64,
torch format, as its own preprocessing saves them), keeps rows `[0, int(n * train_ratio))` as its train split
and the rest as its validation split, and, through `hs_connectors.FileTransfer(datapath / "hidden_states")`,
loads row i's states from `hidden_states/hs_{i}.safetensors` holding

- `token_ids`: [L] int64, compared with the row's `input_ids` (a mismatch makes the sample unavailable),
- `hidden_states`: [L, n_layers, H]: the aux layers low, mid, high, then the verifier's last hidden state
  (`hidden_states[:, :-1]` becomes the drafter input, `hidden_states[:, -1]` the `verifier_last_hidden_states`
  from which `Eagle3DraftModel.forward` computes its targets as `verifier_lm_head(verifier_norm(...))`: the
  state *before* the final norm, which is what the run stores, `storage.FINAL_STATE`).

Rows are in export index order: training samples first, then the held-out prompts, so the manifest's
`train_data_ratio` makes speculators' own split the prompt split. The dataset folder is written with pyarrow
(`arrow_disk.py`): per source part one file of its training rows and, after all of those, one file of its
held-out rows, named by the part's number (`state.json` lists them in index order; `datasets` reads the names it
lists), so a part a rerun leaves alone keeps its files when other parts arrive, where `save_to_disk`'s
`data-K-of-N` names would all change with N. `token_freq.pt` is what
`speculators.train.vocab_mapping.save_token_frequency_distribution` writes (a dict token id -> count of
loss-masked occurrences) over the training rows; speculators' trainer finds it in the data path and builds its
draft vocabulary (`d2t`, `t2d`) from it for `--draft-vocab-size N`, and the export can write those files itself
with speculators' own utility (`vocab_mapping_files`).
"""

from __future__ import annotations

import importlib.util
import io
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save

from tasks.common.shards import atomic_write_bytes
from tasks.export.arrow_disk import write_data_file, write_dataset_metadata
from tasks.export.errors import ExportError
from tasks.export.progress import PartSlot
from tasks.export.source import ExportSample, iter_samples

HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
LAYOUT = "rows-per-part-v2"
"""Recorded in each part's export marker: a marker of the earlier `data-K-of-N` naming no longer matches, so
such a part is written again under its own names."""
VOCAB_FILE_GLOBS = ("d2t-*.npy", "t2d-*.npy")
ROW_SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int64())),
        pa.field("loss_mask", pa.list_(pa.int64())),
        pa.field("seq_len", pa.int64()),
    ]
)


def states_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / HIDDEN_STATES_DIR / f"hs_{index}.safetensors"


def part_data_files(part: int) -> tuple[str, str]:
    """(training rows, held-out rows) of one source part."""
    return f"data-{part:05d}-train.arrow", f"data-{part:05d}-heldout.arrow"


def data_files(slots: list[PartSlot]) -> list[str]:
    """Every part's training-row file, then every part's held-out-row file, in part order: the rows' index
    order (training indices come first, numbered part by part, then held-out ones likewise)."""
    names = [part_data_files(s.part.ref.part) for s in slots]
    return [train for train, _ in names] + [held for _, held in names]


def stacked_states(sample: ExportSample) -> torch.Tensor:
    """[L, 3H] aux + [L, H] pre-norm final -> [L, 4, H], aux layers first in their stored order, final last."""
    length, width = sample.final.shape
    aux = sample.aux.reshape(length, -1, width)
    return torch.cat([aux, sample.final.unsqueeze(1)], dim=1).contiguous()


def write_part(out_dir: Path, slot: PartSlot) -> int:
    written = 0
    rows: dict[bool, list[tuple[int, list[int], list[int]]]] = {False: [], True: []}
    for n, sample in enumerate(iter_samples(slot.part)):
        index = slot.indices[n]
        data = save({"token_ids": sample.input_ids.contiguous(), "hidden_states": stacked_states(sample)})
        atomic_write_bytes(states_path(out_dir, index), data)
        written += len(data)
        rows[slot.validation[n]].append((index, sample.input_ids.tolist(), sample.loss_mask.tolist()))
    for held_out, name in zip((False, True), part_data_files(slot.part.ref.part), strict=True):
        ordered = sorted(rows[held_out])
        table = pa.table(
            {
                "input_ids": [ids for _, ids, _ in ordered],
                "loss_mask": [mask for _, _, mask in ordered],
                "seq_len": [len(ids) for _, ids, _ in ordered],
            },
            schema=ROW_SCHEMA,
        )
        written += write_data_file(Path(out_dir) / name, table)
    return written


def token_frequencies(out_dir: Path, slots: list[PartSlot]) -> dict[int, int]:
    """Loss-masked token counts over the training rows, as `save_token_frequency_distribution` counts them."""
    counts: Counter[int] = Counter()
    for name in data_files(slots)[: len(slots)]:
        with pa.memory_map(str(Path(out_dir) / name)) as source:
            table = pa.ipc.open_stream(source).read_all()
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(), strict=True):
            counts.update(t for t, m in zip(ids, mask, strict=True) if m)
    return dict(counts)


def finish(out_dir: Path, slots: list[PartSlot]) -> tuple[dict[int, int], int]:
    """`dataset_info.json`, `state.json` and `token_freq.pt`, after every part's files are in place; returns the
    frequencies and how many draft-vocabulary files of other frequencies were removed.

    speculators' trainer prefers `d2t-N.npy` / `t2d-N.npy` in its data path to `token_freq.pt`, and writes them
    there itself on its first run: when the frequencies change, any such file (from an earlier export's
    `--draft-vocab-size` or from the trainer) describes rows that are gone and is removed first.
    """
    out_dir = Path(out_dir)
    write_dataset_metadata(out_dir, ROW_SCHEMA, data_files(slots), "torch")
    freq = token_frequencies(out_dir, slots)
    path = out_dir / TOKEN_FREQ_FILE
    removed = 0
    if not path.is_file() or torch.load(path, weights_only=True) != freq:
        for pattern in VOCAB_FILE_GLOBS:
            for stale in out_dir.glob(pattern):
                stale.unlink()
                removed += 1
        atomic_write_bytes(path, _saved(freq))
    return freq, removed


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def require_vocab_utility() -> None:
    """Checked before an export starts: a draft vocabulary is built with speculators' own utility."""
    if importlib.util.find_spec("speculators") is None:
        raise ExportError(
            "a draft vocabulary for speculators is built with speculators' own utility, and speculators is not "
            "installed here; export without --draft-vocab-size (speculators' trainer builds d2t/t2d from "
            f"{TOKEN_FREQ_FILE} itself) or run the export where speculators==0.9.0 is installed"
        )


def vocab_mapping_files(
    out_dir: Path, freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int
) -> list[str]:
    """`d2t-N.npy` and `t2d-N.npy`, built by speculators' own `build_vocab_mappings_from_distribution`, where its
    trainer looks for them (`--draft-vocab-size N` with this directory as `--data-path`)."""
    require_vocab_utility()
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=freq, draft_vocab_size=draft_vocab_size, target_vocab_size=target_vocab_size
    )
    names = [f"d2t-{draft_vocab_size}.npy", f"t2d-{draft_vocab_size}.npy"]
    for name, tensor in zip(names, (d2t, t2d), strict=True):
        atomic_write_bytes(Path(out_dir) / name, _npy(tensor.cpu().numpy()))
    return names


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def remove_stale(out_dir: Path, total: int, slots: list[PartSlot]) -> int:
    """Delete states and data files a previous export with more samples or other parts left behind."""
    removed = 0
    for path in (Path(out_dir) / HIDDEN_STATES_DIR).glob("hs_*.safetensors"):
        index = path.name[len("hs_") : -len(".safetensors")]
        if not index.isdigit() or int(index) >= total:
            path.unlink()
            removed += 1
    expected = set(data_files(slots))
    for path in Path(out_dir).glob("data-*.arrow"):
        if path.name not in expected:
            path.unlink()
            removed += 1
    return removed


def trainer_arguments(layers: list[int], num_layers: int, train_ratio: float) -> dict[str, object]:
    """What speculators' trainer must be told about this data, in its own conventions: `--target-layer-ids` are
    indices into transformers' `output_hidden_states` (vLLM's `aux_hidden_state_layers`, default
    [2, N//2, N-3]), i.e. our layer-output ids + 1; the final state is id N."""
    return {
        "target_layer_ids": [k + 1 for k in layers],
        "verifier_final_layer_id": num_layers,
        "train_data_ratio": train_ratio,
        "token_freq_path": TOKEN_FREQ_FILE,
    }

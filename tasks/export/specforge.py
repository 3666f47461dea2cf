"""SpecForge's offline EAGLE-3 layout: one `torch.save`d dict per sample.

Read from SpecForge's source (sgl-project/SpecForge `scripts/prepare_hidden_states.py`, which writes it, and
`specforge/data/preprocessing.py` `OfflineEagle3Dataset` / `list_local_files` in specforge 0.2.0, which read
it): files `rows_{g}-{g + 2000}/data_{i}.ckpt` (i the global sample index, g = i rounded down to the group
size 2000), each holding

- `input_ids`: [L] int64, `loss_mask`: [L] int64 (the reader zeroes the last position itself),
- `hidden_state`: [1, L, H], the reader's `target`, from which SpecForge's trainer computes the teacher logits
  as `TargetHead.fc(target)`, the lm_head *alone* (`training/strategies/base.py:_prepare_eagle_target`): so this
  is the target's *post*-norm state, `norm(pre_norm)` with the target's own final norm (`final_norm.py`), as
  SpecForge's own capture stores SGLang's post-norm `last_hidden_states`,
- `aux_hidden_state`: [1, L, 3H], low/mid/high layer outputs concatenated (the reader's `hidden_state`),

in the model dtype. Training samples go under `train/`, held-out prompts under `eval/` (SpecForge's
`--train-hidden-states-path` / `--eval-hidden-states-path`): the reader walks a directory for every `*.ckpt`.
Each file is a complete zip-format `torch.save` of tensors that own exactly their bytes (a slice of a shard
would drag the shard's whole storage into the file), written under a temporary name and renamed.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import torch
from torch import nn

from tasks.common.shards import atomic_write_bytes
from tasks.export.errors import ExportError
from tasks.export.final_norm import apply_norm
from tasks.export.progress import PartSlot
from tasks.export.source import ExportSample, iter_samples

FILE_GROUP_SIZE = 2000
SUFFIX = ".ckpt"
TRAIN_DIR = "train"
EVAL_DIR = "eval"


def sample_path(out_dir: Path, index: int, validation: bool = False) -> Path:
    group = (index // FILE_GROUP_SIZE) * FILE_GROUP_SIZE
    split = EVAL_DIR if validation else TRAIN_DIR
    return Path(out_dir) / split / f"rows_{group}-{group + FILE_GROUP_SIZE}" / f"data_{index}{SUFFIX}"


def sample_record(sample: ExportSample, norm: nn.Module) -> dict[str, torch.Tensor]:
    """The file's tensors, each a fresh compact copy (`clone` of a contiguous slice owns only its bytes)."""
    return {
        "input_ids": sample.input_ids.clone(),
        "loss_mask": sample.loss_mask.clone(),
        "hidden_state": apply_norm(norm, sample.final).unsqueeze(0).clone(),
        "aux_hidden_state": sample.aux.unsqueeze(0).clone(),
    }


def write_part(out_dir: Path, slot: PartSlot, norm: nn.Module) -> int:
    written = 0
    for n, sample in enumerate(iter_samples(slot.part)):
        buffer = io.BytesIO()
        torch.save(sample_record(sample, norm), buffer)
        data = buffer.getvalue()
        atomic_write_bytes(sample_path(out_dir, slot.indices[n], slot.validation[n]), data)
        written += len(data)
    return written


def remove_stale(out_dir: Path, slots: list[PartSlot]) -> int:
    """Delete sample files a previous, larger or differently split export left: SpecForge trains on every
    `*.ckpt` it finds under the directory it is given."""
    expected = {sample_path(out_dir, i, v) for s in slots for i, v in zip(s.indices, s.validation, strict=True)}
    removed = 0
    found = [*Path(out_dir).glob(f"*/rows_*/data_*{SUFFIX}"), *Path(out_dir).glob(f"rows_*/data_*{SUFFIX}")]
    for path in found:  # the second pattern: the unsplit layout of earlier exports
        if path not in expected:
            path.unlink()
            removed += 1
    return removed


def require_vocab_utility() -> None:
    """Checked before an export starts: a draft vocabulary is built with SpecForge's own utilities."""
    if importlib.util.find_spec("specforge") is None:
        raise ExportError(
            "a draft vocabulary for SpecForge is built with SpecForge's own utilities, and specforge is not "
            "installed here; export without --draft-vocab-size (SpecForge's offline trainer derives it from the "
            "training files itself) or run the export where specforge==0.2.0 is installed"
        )


def vocab_mapping_file(out_dir: Path, draft_vocab_size: int, target_vocab_size: int) -> str:
    """`vocab_mapping-N.pt` ({"d2t", "t2d"}), built the way SpecForge's offline trainer builds it when given no
    mapping (`training/assembly.py:_ensure_offline_vocab_mapping`): `count_effective_feature_tokens` over the
    training files, then `process_token_dict_to_mappings`; pass it as `model.vocab_mapping_path`."""
    require_vocab_utility()
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    counts = count_effective_feature_tokens(str(Path(out_dir) / TRAIN_DIR), target_vocab_size=target_vocab_size)
    d2t, t2d = process_token_dict_to_mappings(counts, draft_vocab_size, target_vocab_size)
    name = f"vocab_mapping-{draft_vocab_size}.pt"
    buffer = io.BytesIO()
    torch.save({"d2t": d2t, "t2d": t2d}, buffer)
    atomic_write_bytes(Path(out_dir) / name, buffer.getvalue())
    return name


def trainer_arguments(layers: list[int], has_eval: bool, vocab_mapping: str | None) -> dict[str, object]:
    """What SpecForge's trainer must be told, in its convention: its aux layer ids are the ids it hands to SGLang's
    `set_eagle3_layers_to_capture` (default [1, N//2-1, N-4]), i.e. ours unchanged."""
    return {
        "aux_hidden_state_layer_ids": list(layers),
        "train_hidden_states_path": TRAIN_DIR,
        "eval_hidden_states_path": EVAL_DIR if has_eval else None,
        "vocab_mapping_path": vocab_mapping,
    }

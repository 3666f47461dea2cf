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

in bf16 whatever the run stored (`TENSOR_DTYPE`). Training samples go under `train/`, held-out prompts under
`eval/` (SpecForge 0.2.0's `data.hidden_states_path` / `data.eval_hidden_states_path`): the reader walks a
directory for every `*.ckpt`. `specforge_config.yaml` beside them is a SpecForge 0.2.0 run config (its own schema,
`specforge.config.schema.Config`) that names them, the aux layer ids, the target and how to read its lm_head, for
`specforge train -c <out>/specforge_config.yaml [overrides]`.
Each file is a complete zip-format `torch.save` of tensors that own exactly their bytes (a slice of a shard
would drag the shard's whole storage into the file), written under a temporary name and renamed.
"""

from __future__ import annotations

import importlib.util
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import safe_open
from torch import nn

from tasks.common.shards import atomic_write_bytes, atomic_write_text
from tasks.export.errors import ExportError
from tasks.export.final_norm import apply_norm
from tasks.export.progress import PartSlot
from tasks.export.source import ExportSample, iter_samples

FILE_GROUP_SIZE = 2000
SUFFIX = ".ckpt"
TRAIN_DIR = "train"
EVAL_DIR = "eval"
CONFIG_FILE = "specforge_config.yaml"
TENSOR_DTYPE = torch.bfloat16
"""SpecForge 0.2.0's `TargetHead.from_pretrained` moves the lm_head to bf16 whatever `model.torch_dtype` says and
applies it to each file's `hidden_state` (a float32 state fails that matmul); the aux states feed a draft that
runs at `model.torch_dtype`, bf16 by default. A float32 run is exported rounded to bf16."""
LAYOUT = "bf16-v2"
"""Recorded in each part's export marker: a part exported before the files were always bf16 is written again."""
DEFAULT_MAX_LENGTH = 2048
"""SpecForge 0.2.0's `data.max_length` default: it trains on, and counts its draft vocabulary over, the first
`max_length` tokens of each sample."""
DRAFT_VOCAB_SIZE = 32000
"""The draft vocabulary SpecForge 0.2.0's generated draft config has: its schema has no setting for it, only a
draft config file of one's own (`model.draft_model_config`) changes it."""
EVAL_INTERVAL = 500
"""`training.eval_interval` in the written config: SpecForge 0.2.0 refuses eval data without one (steps)."""


def sample_path(out_dir: Path, index: int, validation: bool = False) -> Path:
    group = (index // FILE_GROUP_SIZE) * FILE_GROUP_SIZE
    split = EVAL_DIR if validation else TRAIN_DIR
    return Path(out_dir) / split / f"rows_{group}-{group + FILE_GROUP_SIZE}" / f"data_{index}{SUFFIX}"


def sample_record(sample: ExportSample, norm: nn.Module) -> dict[str, torch.Tensor]:
    """The file's tensors, each a fresh compact copy (`clone` of a contiguous slice owns only its bytes)."""
    return {
        "input_ids": sample.input_ids.clone(),
        "loss_mask": sample.loss_mask.clone(),
        "hidden_state": apply_norm(norm, sample.final).to(TENSOR_DTYPE).unsqueeze(0).clone(),
        "aux_hidden_state": sample.aux.to(TENSOR_DTYPE).unsqueeze(0).clone(),
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


def remove_vocab_mappings(out_dir: Path, keep: int | None) -> int:
    """Delete `vocab_mapping-N.pt` files other than the one this export writes: one left from earlier rows is
    not what SpecForge would derive from these."""
    removed = 0
    for path in Path(out_dir).glob("vocab_mapping-*.pt"):
        if path.name != f"vocab_mapping-{keep}.pt":
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


def vocab_mapping_file(out_dir: Path, draft_vocab_size: int, target_vocab_size: int, max_length: int) -> str:
    """`vocab_mapping-N.pt` ({"d2t", "t2d"}), built the way SpecForge's offline trainer builds it when given no
    mapping (`training/assembly.py:_ensure_offline_vocab_mapping`): `count_effective_feature_tokens` over the
    training files' first `max_length` tokens (its `data.max_length`), then `process_token_dict_to_mappings`;
    the written config names it as `model.vocab_mapping_path`."""
    require_vocab_utility()
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    counts = count_effective_feature_tokens(
        str(Path(out_dir) / TRAIN_DIR), max_length=max_length, target_vocab_size=target_vocab_size
    )
    d2t, t2d = process_token_dict_to_mappings(counts, draft_vocab_size, target_vocab_size)
    name = f"vocab_mapping-{draft_vocab_size}.pt"
    buffer = io.BytesIO()
    torch.save({"d2t": d2t, "t2d": t2d}, buffer)
    atomic_write_bytes(Path(out_dir) / name, buffer.getvalue())
    return name


@dataclass(frozen=True)
class HeadSource:
    """Where SpecForge 0.2.0 finds the target's lm_head and embedding (`model.lm_head_key`, `model.embedding_key`)
    and what will stop it: `TargetHead.load_weights` looks `lm_head_key` up in the one `*.index.json` of the
    target directory, so a tied model (no `lm_head.weight`; its embedding is the head) needs the embedding's key,
    and a single-file checkpoint needs an index."""

    lm_head_key: str | None
    embedding_key: str | None
    problems: list[str] = field(default_factory=list)


def _weight_names(model_dir: Path) -> tuple[list[str], list[Path]]:
    indexes = sorted(model_dir.glob("*.index.json"))
    names: list[str] = []
    for index in indexes:
        names += list(json.loads(index.read_text()).get("weight_map", {}))
    if not indexes:
        for single in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(single), framework="pt") as f:
                names += list(f.keys())
    return names, indexes


def _key_ending(names: list[str], suffix: str) -> str | None:
    found = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    return found[0] if found else None


def head_source(model_dir: Path, tied: bool) -> HeadSource:
    model_dir = Path(model_dir)
    names, indexes = _weight_names(model_dir)
    embedding = _key_ending(names, "embed_tokens.weight")
    head = _key_ending(names, "lm_head.weight") or (embedding if tied else None)
    problems = []
    if head is None:
        problems.append(f"{model_dir} names no lm_head weight (nor a tied embedding): set model.lm_head_key yourself")
    if len(indexes) != 1:
        single = sorted(p.name for p in model_dir.glob("*.safetensors"))
        hint = (
            f": write {model_dir}/model.safetensors.index.json mapping every tensor of {single[0]} "
            "(docs/extraction.md, Trainer export, has the one-line command)"
            if len(single) == 1
            else ""
        )
        problems.append(
            f"SpecForge 0.2.0 reads the target's lm_head ({head}) through exactly one *.index.json, and "
            f"{model_dir} has {len(indexes)}{hint}"
        )
    return HeadSource(head, embedding, problems)


def trainer_config(
    out_dir: Path,
    model_dir: Path,
    layers: list[int],
    has_eval: bool,
    vocab_mapping: str | None,
    max_length: int,
    head: HeadSource,
) -> dict[str, Any]:
    """The SpecForge 0.2.0 run config (`specforge.config.schema.Config`) that trains on this export: its aux
    layer ids are the ids it hands SGLang's `set_eagle3_layers_to_capture` (default [1, N//2-1, N-4]), i.e. ours
    unchanged; paths are absolute."""
    out_dir, model_dir = Path(out_dir).resolve(), Path(model_dir).resolve()
    model: dict[str, Any] = {
        "target_model_path": str(model_dir),
        "aux_hidden_state_layer_ids": list(layers),
        "torch_dtype": "bfloat16",
    }
    if head.lm_head_key:
        model["lm_head_key"] = head.lm_head_key
    if head.embedding_key:
        model["embedding_key"] = head.embedding_key
    if vocab_mapping == f"vocab_mapping-{DRAFT_VOCAB_SIZE}.pt":
        model["vocab_mapping_path"] = str(out_dir / vocab_mapping)
    data: dict[str, Any] = {"hidden_states_path": str(out_dir / TRAIN_DIR), "max_length": max_length}
    config: dict[str, Any] = {"model": model, "data": data}
    if has_eval:
        data["eval_hidden_states_path"] = str(out_dir / EVAL_DIR)
        config["training"] = {"eval_interval": EVAL_INTERVAL}
    return config


def draft_vocab_problem(draft_vocab_size: int | None) -> list[str]:
    """A mapping of another size than SpecForge's generated draft has fails its `load_vocab_mapping` (tensor
    sizes 32000 vs N): the config then leaves the mapping out (SpecForge derives its own 32,000-token one)."""
    if draft_vocab_size is None or draft_vocab_size == DRAFT_VOCAB_SIZE:
        return []
    return [
        f"vocab_mapping-{draft_vocab_size}.pt is not named in {CONFIG_FILE}: SpecForge 0.2.0 generates a draft with "
        f"{DRAFT_VOCAB_SIZE:,} draft tokens and has no setting for another size; to train with "
        f"{draft_vocab_size:,}, give it model.draft_model_config (a draft config with draft_vocab_size: "
        f"{draft_vocab_size}) and model.vocab_mapping_path, or export with --draft-vocab-size {DRAFT_VOCAB_SIZE}"
    ]


def write_trainer_config(out_dir: Path, config: dict[str, Any], problems: list[str]) -> None:
    header = [
        "# SpecForge 0.2.0 run config for this export, written by `eagle3-datagen export`.",
        "# Train: specforge train -c specforge_config.yaml [training.num_epochs=N training.learning_rate=X ...]",
        *(f"# WARNING: {p}" for p in problems),
    ]
    text = "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False)
    atomic_write_text(Path(out_dir) / CONFIG_FILE, text)

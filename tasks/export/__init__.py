"""Trainer interop: a run's hidden states in SpecForge's and speculators' offline layouts.

`export_run` walks the finished hidden-states parts of a run directory, re-checks every sample against its
tokens (ids, loss mask length, shapes, finite values, the stored final state's meaning) and writes the chosen
layout part by part, resumably; `eagle3_export.json` in the output directory marks a finished export and tells
the trainer what it needs in its own conventions (layer ids, the validation split, the vocabulary files).

Each trainer gets the final state its own target computation expects: speculators normalizes the verifier's
last hidden state itself (`lm_head(norm(h))`), so it gets the stored pre-norm state; SpecForge applies only the
lm_head to its `hidden_state`, so it gets the target's own final norm applied to that state (`final_norm.py`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from transformers import AutoConfig

from tasks.export import specforge, speculators
from tasks.export.errors import ExportError
from tasks.export.final_norm import load_final_norm, norm_fingerprint
from tasks.export.progress import ExportProgress, PartSlot, assign_slots
from tasks.export.source import SourcePart, source_parts
from tasks.export.split import in_validation, prompt_ids, train_ratio
from tasks.extract.storage import DTYPES, FINAL_STATE, dtype_name
from tasks.scoring.policy import recorded_scoring, sample_reasons

ExportFormat = Literal["specforge", "speculators"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("specforge", "speculators")
DEFAULT_VAL_FRACTION = 0.05
POST_NORM = "post_norm"
"""The SpecForge export's final state: the stored pre-norm state with the target's final norm applied."""

__all__ = ["DEFAULT_VAL_FRACTION", "EXPORT_FORMATS", "ExportError", "ExportFormat", "export_run"]


def _one_layout(parts: list[SourcePart]) -> tuple[list[int], int, str, int]:
    """(layers, hidden size, dtype, num_layers) shared by every part; a trainer takes one set of layer ids."""
    found = {
        (
            tuple(p.layout.layers),
            p.layout.hidden_size,
            dtype_name(p.layout.dtype),
            p.provenance.get("extract_num_layers"),
        )
        for p in parts
        if p.layout is not None
    }
    if len(found) != 1:
        raise ExportError(f"the run's hidden-states parts differ in layers/hidden size/dtype/depth: {sorted(found)}")
    layers, hidden, dtype, num_layers = found.pop()
    if not isinstance(num_layers, int):
        raise ExportError("the hidden-states index provenance lacks extract_num_layers; re-run extract")
    return list(layers), hidden, dtype, num_layers


def _target_model(parts: list[SourcePart], override: Path | None) -> Path:
    if override is not None:
        return Path(override)
    paths = {str(p.provenance.get("extract_model_path")) for p in parts}
    if len(paths) != 1 or "None" in paths:
        raise ExportError(f"the run's parts name target models {sorted(paths)}; pass the target model directory")
    return Path(paths.pop())


def export_run(
    run_dir: Path,
    fmt: str,
    out_dir: Path,
    *,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    split_seed: int = 0,
    draft_vocab_size: int | None = None,
    target_model: Path | None = None,
    trust_remote_code: bool = False,
    score_policy: str | None = None,
    max_length: int | None = None,
) -> dict[str, Any]:
    """Export every finished hidden-states part of `run_dir` to `out_dir`; returns the export's stats.

    `val_fraction` of the prompts (by hash of prompt id) are held out; `target_model` overrides the model
    directory recorded at extraction (read for the final norm, the vocabulary size); `draft_vocab_size` also
    writes the draft-vocabulary mapping with the trainer's own utility (which must then be installed).
    Samples outside the run's scoring bounds (`tasks.scoring.policy`) are kept, flagged in the manifest or
    left out, by `score_policy` (default: the run's `scoring.sample_policy`). `max_length` is SpecForge's
    `data.max_length` (its draft vocabulary counts the first `max_length` tokens of each sample).
    """
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"export format {fmt!r} not one of {list(EXPORT_FORMATS)}")
    if max_length is not None and (fmt != "specforge" or max_length <= 0):
        raise ExportError(f"max length {max_length} is SpecForge's data.max_length: a positive number, specforge only")
    max_length = max_length or specforge.DEFAULT_MAX_LENGTH
    if draft_vocab_size is not None:
        (specforge if fmt == "specforge" else speculators).require_vocab_utility()
    started = time.monotonic()
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    parts = source_parts(run_dir)
    scfg = recorded_scoring(run_dir)
    if score_policy is not None:
        if score_policy not in ("keep", "flag", "drop"):
            raise ExportError(f"score policy {score_policy!r} not one of keep, flag, drop")
        scfg = scfg.model_copy(update={"sample_policy": score_policy})
    reasons, unscored = sample_reasons(run_dir, [p.ref.part for p in parts], scfg)
    counted = Counter(r for sid in (s for p in parts for s in p.sample_ids) for r in reasons.get(sid, []))
    dropped = 0
    if scfg.sample_policy == "drop":
        kept = [replace(p, rows=[r for r in p.rows if str(r["sample_id"]) not in reasons]) for p in parts]
        dropped = sum(len(p.rows) for p in parts) - sum(len(p.rows) for p in kept)
        parts = kept
    groups = prompt_ids(run_dir)
    slots = assign_slots(parts, lambda sid: in_validation(groups.get(sid, sid), val_fraction, split_seed))
    all_ids = [sid for p in parts for sid in p.sample_ids]
    ungrouped = sum(sid not in groups for sid in all_ids)
    n_val = sum(v for s in slots for v in s.validation)
    n_total = len(all_ids)
    ratio = train_ratio(n_total - n_val, n_total)
    populated = [p for p in parts if p.rows]
    layers, hidden, dtype, num_layers = _one_layout(populated) if populated else ([], 0, "", 0)
    model_dir = _target_model(parts, target_model)
    norm = None
    if fmt == "specforge" and populated:
        norm = load_final_norm(model_dir, DTYPES[dtype], trust_remote_code=trust_remote_code)
    layout = speculators.LAYOUT if fmt == "speculators" else specforge.LAYOUT
    applied = {"final_norm": norm_fingerprint(norm)} if norm is not None else None
    progress = ExportProgress(out_dir, fmt, run_dir, layout, applied)
    progress.start()
    written, skipped = 0, 0
    for slot in slots:
        if progress.is_done(slot):
            skipped += 1
            continue
        if fmt == "speculators":
            written += speculators.write_part(out_dir, slot)
        elif slot.count:
            if norm is None:
                raise ExportError("the target's final norm was not loaded")
            written += specforge.write_part(out_dir, slot, norm)
        progress.mark_done(slot)
    stale = (  # before the closing files: SpecForge's vocabulary count walks every file under train/
        specforge.remove_stale(out_dir, slots)
        if fmt == "specforge"
        else speculators.remove_stale(out_dir, n_total, slots)
    )
    config: Any = (  # a speculators export without a draft vocabulary reads nothing of the target
        AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
        if fmt == "specforge" or draft_vocab_size is not None
        else None
    )
    vocab_files, stale_vocab = _finish(fmt, out_dir, slots, config, draft_vocab_size, max_length)
    stale += stale_vocab
    warnings: list[str] = []
    trainer: dict[str, Any]
    if fmt == "specforge":
        head = specforge.head_source(model_dir, bool(config.get_text_config().tie_word_embeddings))
        warnings += head.problems + specforge.draft_vocab_problem(draft_vocab_size)
        trainer_config = specforge.trainer_config(
            out_dir, model_dir, layers, n_val > 0, vocab_files[0] if vocab_files else None, max_length, head
        )
        specforge.write_trainer_config(out_dir, trainer_config, warnings)
        trainer = {"config_file": specforge.CONFIG_FILE, "config": trainer_config}
    else:
        trainer = speculators.trainer_arguments(layers, num_layers, ratio)
        if n_total and not n_val:  # speculators' create_train_val_loaders raises on a ratio of 1.0
            warnings.append(
                f"no prompt fell in the validation split (fraction {val_fraction} of {n_total} samples): "
                "speculators refuses train_data_ratio 1.0 (it must be in (0, 1)); re-export with a larger "
                "--val-fraction"
            )
    manifest = progress.finish(
        slots,
        {
            "layouts": [{"layers": layers, "hidden_size": hidden, "dtype": dtype}] if populated else [],
            "exported_dtype": dtype_name(specforge.TENSOR_DTYPE) if fmt == "specforge" else dtype,
            "final_state": FINAL_STATE if fmt == "speculators" else POST_NORM,
            "target_model": str(model_dir),
            "validation": {
                "fraction": val_fraction,
                "seed": split_seed,
                "group": "prompt_id",
                "samples_grouped_by_own_id": ungrouped,
                "samples": n_val,
            },
            "vocab_files": vocab_files,
            "trainer": trainer,
            "scores": _scores_manifest(slots, reasons, unscored, counted, dropped, scfg),
            "warnings": warnings,
        },
    )
    return {
        "format": fmt,
        "out": str(out_dir),
        "samples": manifest["samples"],
        "validation_samples": n_val,
        "parts": len(slots),
        "parts_skipped": skipped,
        "bytes_written": written,
        "stale_files_removed": stale,
        "score_policy": scfg.sample_policy,
        "out_of_bounds": sum(1 for p in parts for s in p.sample_ids if s in reasons) + dropped,
        "dropped_out_of_bounds": dropped,
        "wall_s": round(time.monotonic() - started, 3),
        "warnings": warnings,
    }


def _scores_manifest(
    slots: list[PartSlot],
    reasons: dict[str, list[str]],
    unscored: list[int],
    counted: Counter[str],
    dropped: int,
    scfg: Any,
) -> dict[str, Any]:
    """What the target's scores say about the exported samples: the policy and bounds applied, samples outside
    them by reason, how many were left out, and (policy flag) each flagged sample's index and reasons."""
    flagged = [
        {"index": index, "sample_id": sid, "reasons": reasons[sid]}
        for slot in slots
        for index, sid in zip(slot.indices, slot.part.sample_ids, strict=True)
        if sid in reasons
    ]
    return {
        "policy": scfg.sample_policy,
        "bounds": scfg.bounds(),
        "low_prob_floor": scfg.low_prob_floor,
        "unscored_parts": unscored,
        "out_of_bounds_by_reason": dict(sorted(counted.items())),
        "dropped": dropped,
        "flagged": flagged if scfg.sample_policy == "flag" else [],
    }


def _finish(
    fmt: str,
    out_dir: Path,
    slots: list[PartSlot],
    config: Any,
    draft_vocab_size: int | None,
    max_length: int,
) -> tuple[list[str], int]:
    """The format's closing files; the draft-vocabulary files when a draft vocabulary size is asked for. Returns
    their names and how many stale vocabulary files were removed."""
    if fmt == "speculators":
        freq, removed = speculators.finish(out_dir, slots)
    else:
        freq, removed = None, specforge.remove_vocab_mappings(out_dir, keep=draft_vocab_size)
    if draft_vocab_size is None:
        return ([speculators.TOKEN_FREQ_FILE] if fmt == "speculators" else []), removed
    vocab = int(config.get_text_config().vocab_size)
    if not 0 < draft_vocab_size <= vocab:
        raise ExportError(f"draft vocabulary size {draft_vocab_size} not in [1, {vocab}] (the target's vocabulary)")
    if freq is not None:
        files = speculators.vocab_mapping_files(out_dir, freq, draft_vocab_size, vocab)
        return [speculators.TOKEN_FREQ_FILE, *files], removed
    return [specforge.vocab_mapping_file(out_dir, draft_vocab_size, vocab, max_length)], removed

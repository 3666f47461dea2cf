"""A train directory trained with other shape-defining options is started over, not resumed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tasks.train.stage import (
    CHECKPOINT_DIR,
    EXPORT_DIR,
    OPTIONS_NAME,
    SUMMARY_NAME,
    TrainOptions,
    discard_incompatible,
)


def _trained_dir(tmp_path: Path, options: TrainOptions) -> Path:
    out = tmp_path / "train"
    (out / EXPORT_DIR).mkdir(parents=True)
    (out / CHECKPOINT_DIR / "0").mkdir(parents=True)
    (out / OPTIONS_NAME).write_text(json.dumps(asdict(options)))
    (out / SUMMARY_NAME).write_text(json.dumps({"options": asdict(options)}))
    return out


def test_another_draft_vocabulary_starts_over(tmp_path: Path) -> None:
    out = _trained_dir(tmp_path, TrainOptions(draft_vocab_size=8192))
    assert discard_incompatible(out, TrainOptions(draft_vocab_size=4096)) == ["draft_vocab_size"]
    assert not (out / EXPORT_DIR).exists() and not (out / CHECKPOINT_DIR).exists()
    assert not (out / SUMMARY_NAME).exists()


def test_more_epochs_or_another_learning_rate_resume(tmp_path: Path) -> None:
    out = _trained_dir(tmp_path, TrainOptions(epochs=2, lr=1e-3))
    assert discard_incompatible(out, TrainOptions(epochs=3, lr=3e-3)) == []
    assert (out / EXPORT_DIR).is_dir() and (out / CHECKPOINT_DIR / "0").is_dir()


def test_a_summary_without_an_options_file_is_compared_too(tmp_path: Path) -> None:
    out = _trained_dir(tmp_path, TrainOptions(val_fraction=0.05))
    (out / OPTIONS_NAME).unlink()
    assert discard_incompatible(out, TrainOptions(val_fraction=0.25)) == ["val_fraction"]
    assert not (out / CHECKPOINT_DIR).exists()


def test_a_fresh_directory_has_nothing_to_discard(tmp_path: Path) -> None:
    assert discard_incompatible(tmp_path / "train", TrainOptions()) == []

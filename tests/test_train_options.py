"""A train directory trained with other shape-defining options, or on other data, is started over, not resumed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from tasks.train.stage import (
    CHECKPOINT_DIR,
    DATA_KEY,
    EXPORT_DIR,
    OPTIONS_NAME,
    SUMMARY_NAME,
    TrainOptions,
    discard_incompatible,
    finished_summary,
)

DATA = {"part-00000": "fp-a", "part-00001": "fp-b"}


def _trained_dir(tmp_path: Path, options: TrainOptions) -> Path:
    out = tmp_path / "train"
    (out / EXPORT_DIR).mkdir(parents=True)
    (out / CHECKPOINT_DIR / "0").mkdir(parents=True)
    (out / OPTIONS_NAME).write_text(json.dumps(asdict(options) | {DATA_KEY: DATA}))
    (out / SUMMARY_NAME).write_text(json.dumps({"options": asdict(options), DATA_KEY: DATA}))
    return out


def test_another_draft_vocabulary_starts_over(tmp_path: Path) -> None:
    out = _trained_dir(tmp_path, TrainOptions(draft_vocab_size=8192))
    assert discard_incompatible(out, TrainOptions(draft_vocab_size=4096), DATA) == ["draft_vocab_size"]
    assert not (out / EXPORT_DIR).exists() and not (out / CHECKPOINT_DIR).exists()
    assert not (out / SUMMARY_NAME).exists()


def test_more_epochs_or_another_learning_rate_resume(tmp_path: Path) -> None:
    out = _trained_dir(tmp_path, TrainOptions(epochs=2, lr=1e-3))
    assert discard_incompatible(out, TrainOptions(epochs=3, lr=3e-3), DATA) == []
    assert (out / EXPORT_DIR).is_dir() and (out / CHECKPOINT_DIR / "0").is_dir()


def test_a_summary_without_an_options_file_is_compared_too(tmp_path: Path) -> None:
    out = _trained_dir(tmp_path, TrainOptions(val_fraction=0.05))
    (out / OPTIONS_NAME).unlink()
    assert discard_incompatible(out, TrainOptions(val_fraction=0.25), DATA) == ["val_fraction"]
    assert not (out / CHECKPOINT_DIR).exists()


def test_a_fresh_directory_has_nothing_to_discard(tmp_path: Path) -> None:
    assert discard_incompatible(tmp_path / "train", TrainOptions(), DATA) == []


def test_a_rerun_that_changed_the_data_starts_training_over_and_keeps_the_export(tmp_path: Path) -> None:
    """A rerun added a part: resuming the old checkpoints (or returning the old summary) would hand back a drafter
    of the old rows; the export stays, since it updates itself part by part."""
    out = _trained_dir(tmp_path, TrainOptions())
    assert discard_incompatible(out, TrainOptions(), DATA | {"part-00002": "fp-c"}) == [DATA_KEY]
    assert (out / EXPORT_DIR).is_dir() and not (out / CHECKPOINT_DIR).exists() and not (out / SUMMARY_NAME).exists()


def test_a_directory_trained_before_data_was_recorded_starts_over(tmp_path: Path) -> None:
    out = _trained_dir(tmp_path, TrainOptions())
    (out / OPTIONS_NAME).write_text(json.dumps(asdict(TrainOptions())))
    assert discard_incompatible(out, TrainOptions(), DATA) == [DATA_KEY]


def test_a_finished_summary_is_returned_only_for_the_same_options_and_data(tmp_path: Path) -> None:
    """A rerun that added samples made `train` hand back the old drafter's summary, exit 0, no warning."""
    out = _trained_dir(tmp_path, TrainOptions())
    checkpoint = out / CHECKPOINT_DIR / "0"
    summary = {"options": asdict(TrainOptions()), DATA_KEY: DATA, "checkpoint": str(checkpoint)}
    (out / SUMMARY_NAME).write_text(json.dumps(summary))
    assert finished_summary(out, TrainOptions(), DATA) == summary | {"resumed": "finished"}
    assert finished_summary(out, TrainOptions(), DATA | {"part-00002": "fp-c"}) is None
    assert finished_summary(out, TrainOptions(epochs=5), DATA) is None


def test_a_run_directory_this_host_does_not_have_is_named_as_such(tmp_path: Path) -> None:
    """The train-gpu deployment's default run_dir is relative to the worker's working directory; a worker whose
    runs live elsewhere (the compose workers mount them at /runs) was told to "run extract first"."""
    from tasks.train.stage import TrainError, hidden_states_provenance

    with pytest.raises(TrainError, match=r"does not exist on this host \(a deployment's run_dir is read where"):
        hidden_states_provenance(tmp_path / "nowhere" / "run")
    (tmp_path / "run").mkdir()
    with pytest.raises(TrainError, match="no finished hidden_states parts: run extract first"):
        hidden_states_provenance(tmp_path / "run")


@pytest.mark.parametrize("made", [False, True])
def test_train_run_refuses_a_run_directory_without_writing_into_it(tmp_path: Path, made: bool) -> None:
    """A UI probe's `run_dir: runs/nope` got `runs/nope/train/train_options.json` written before the check, and
    then "run extract first" for the directory that write had made, not "does not exist on this host"."""
    from tasks.train import train_run
    from tasks.train.stage import TrainError

    run_dir = tmp_path / "nope"
    if made:
        run_dir.mkdir()
    says = "no finished hidden_states parts: run extract first" if made else "does not exist on this host"
    with pytest.raises(TrainError, match=says):
        train_run(run_dir)
    assert (list(run_dir.iterdir()) == []) if made else not run_dir.exists()

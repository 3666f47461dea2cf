"""Train an EAGLE-3 drafter on a run directory with speculators' own trainer (see `stage`)."""

from tasks.train.stage import TrainError, TrainOptions, latest_checkpoint, train_run

__all__ = ["TrainError", "TrainOptions", "latest_checkpoint", "train_run"]

"""Offline acceptance of a trained drafter on held-out prompts (see `stage` and `acceptance`)."""

from tasks.evaluate.stage import TOLERANCE, evaluate_run, evaluation_markdown

__all__ = ["TOLERANCE", "evaluate_run", "evaluation_markdown"]

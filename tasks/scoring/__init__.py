"""The target's scores of its own training data, read after extraction: per-sample bounds and what the exports do
with samples outside them (`policy`), provider parity (`parity`), and the report section, gate and routing hint
(`report`). The scores themselves are written by the extract stage (`tasks/extract/scores.py`)."""

from tasks.scoring.policy import REASONS, out_of_bounds, recorded_scoring
from tasks.scoring.report import ProviderParityError, check_parity_gate, provider_rows, publish_score_report

__all__ = [
    "REASONS",
    "ProviderParityError",
    "check_parity_gate",
    "out_of_bounds",
    "provider_rows",
    "publish_score_report",
    "recorded_scoring",
]

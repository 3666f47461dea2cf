"""The estimate's own error, importable without loading a tokenizer stack (the CLI's exit-code table uses it)."""

from __future__ import annotations

from tasks.common.errors import DatagenError


class EstimateOverBudgetError(DatagenError):
    """The estimate's low end already exceeds `endpoint.max_cost_usd`: the run is refused before it spends."""

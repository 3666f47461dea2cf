"""Typed export errors: each names the run part or sample and what was expected."""

from __future__ import annotations

from tasks.common.errors import DatagenError


class ExportError(DatagenError):
    """A run cannot be exported as asked (aux-only states, states not matching their tokens, foreign output)."""

"""The generate stage: prompts parts -> `responses` parts, via an OpenAI-compatible chat API or SGLang.

The names below are loaded on first use (PEP 562): the engine imports transformers (2-3 s), and the light
modules of this package (the journal, the ledger, the per-dataset summary, the rerun policy) must not pay for
it, nor must a command that stops at a config error.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.generate.endpoints import CompletionMarkers, GenerationResult
    from tasks.generate.engine import GenerateSummary, PartSummary, generate_parts

_HOMES = {
    "CompletionMarkers": "tasks.generate.endpoints",
    "GenerationResult": "tasks.generate.endpoints",
    "GenerateSummary": "tasks.generate.engine",
    "PartSummary": "tasks.generate.engine",
    "generate_parts": "tasks.generate.engine",
}

__all__ = ["CompletionMarkers", "GenerateSummary", "GenerationResult", "PartSummary", "generate_parts"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

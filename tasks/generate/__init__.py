"""The generate stage: prompts parts -> `responses` parts, via an OpenAI-compatible chat API or SGLang."""

from tasks.generate.endpoints import CompletionMarkers, GenerationResult
from tasks.generate.engine import GenerateSummary, PartSummary, generate_parts

__all__ = ["CompletionMarkers", "GenerateSummary", "GenerationResult", "PartSummary", "generate_parts"]

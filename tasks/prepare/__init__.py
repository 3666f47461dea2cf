"""The prepare stage: datasets (JSONL / Parquet, OpenAI or ShareGPT shape) -> `prompts` parts with stable ids."""

from tasks.prepare.datasets import prepare_datasets

__all__ = ["prepare_datasets"]

"""Arrow schemas of every stage's Parquet shards: the only contract between stages.

A shard written with one SCHEMA_VERSION is never read by code expecting another: `shards.read_part` checks the
version and the column types, so a stale run directory fails at the boundary instead of inside a trainer.
"""

from __future__ import annotations

from typing import Final

import pyarrow as pa

SCHEMA_VERSION: Final = 2

STAGES: Final = ("prompts", "responses", "tokens", "validation", "hidden_states")
REPORTS_DIR: Final = "reports"
"""Reports and plots live here, not in a stage folder: a stage folder holds only its parts and markers."""

MESSAGE = pa.struct([pa.field("role", pa.string(), nullable=False), pa.field("content", pa.string())])

PROMPTS = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("source_file", pa.string(), nullable=False),
        pa.field("source_row", pa.int64(), nullable=False),
        pa.field("messages", pa.list_(MESSAGE), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
    ]
)

HISTORY_TURN = pa.struct(
    [
        pa.field("role", pa.string(), nullable=False),
        pa.field("content", pa.string()),
        pa.field("reasoning", pa.string()),
        pa.field("generated", pa.bool_(), nullable=False),
    ]
)

RESPONSE_STATUS: Final = ("done", "failed")

RESPONSES = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("reasoning", pa.string()),
        pa.field("content", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("reasoning_tokens", pa.int64()),
        pa.field("cost_usd", pa.float64()),
        pa.field("provider", pa.string()),
        pa.field("model", pa.string()),
        pa.field("generation_id", pa.string()),
        pa.field("latency_s", pa.float64()),
        pa.field("attempts", pa.int32(), nullable=False),
        pa.field("output_ids", pa.list_(pa.int32())),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("quantization", pa.string()),
        pa.field("failure_reason", pa.string()),
        pa.field("request_seed", pa.int64()),
        pa.field("billed_cost_usd", pa.float64()),
        pa.field("history", pa.list_(HISTORY_TURN)),
    ]
)

TOKENS = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("completion_len", pa.int32(), nullable=False),
        pa.field("reasoning_len", pa.int32(), nullable=False),
        pa.field("completion_format", pa.string(), nullable=False),
        pa.field("token_source", pa.string()),
    ]
)

REFERENCE_MATCH: Final = ("exact", "bpe_artifact", "real_difference", "no_reference")
VERDICTS: Final = ("pass", "warn", "fail", "drop")  # drop: excluded by policy (validation.tool_call_policy)
PROMPT_MATCH: Final = ("exact", "within_tolerance", "drift", "no_usage")

VALIDATION = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("verdict", pa.string(), nullable=False),
        pa.field("reference_match", pa.string(), nullable=False),
        pa.field("first_divergence", pa.int32()),
        pa.field("divergence_ours", pa.string()),
        pa.field("divergence_reference", pa.string()),
        pa.field("structural_issues", pa.list_(pa.string()), nullable=False),
        pa.field("finish_reason", pa.string()),
        pa.field("provider", pa.string()),
        pa.field("billed_completion_tokens", pa.int64()),
        pa.field("our_completion_tokens", pa.int64(), nullable=False),
        pa.field("billing_delta_tokens", pa.int64()),
        pa.field("billing_delta_frac", pa.float64()),
        pa.field("billed_reasoning_tokens", pa.int64()),
        pa.field("our_reasoning_tokens", pa.int64()),
        pa.field("reasoning_delta_tokens", pa.int64()),
        pa.field("billing_flagged", pa.bool_()),
        pa.field("quantization", pa.string()),
        pa.field("billed_prompt_tokens", pa.int64()),
        pa.field("our_prompt_tokens", pa.int64()),
        pa.field("prompt_delta_tokens", pa.int64()),
        pa.field("prompt_match", pa.string()),
        pa.field("boundary_whitespace", pa.bool_()),
        pa.field("token_source", pa.string()),
    ]
)

HIDDEN_STATES_INDEX = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("shard", pa.string(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("length", pa.int32(), nullable=False),
        pa.field("layers", pa.list_(pa.int32()), nullable=False),
        pa.field("hidden_size", pa.int32(), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
    ]
)

SCORES_STAGE: Final = "hidden_states/_scores"
"""The target's scores of each extracted sample, beside the hidden-state index: one part per index part, with
its own marker (built from the index part), so changing a scoring setting never re-extracts states. The folder
starts with an underscore, so `pq.read_table(run_dir / "hidden_states")` still reads the index parts only."""

SCORES = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("scored_tokens", pa.int32(), nullable=False),
        pa.field("mean_nll", pa.float64()),
        pa.field("top1_rate", pa.float64()),
        pa.field("longest_low_prob_run", pa.int32(), nullable=False),
        pa.field("end_logprob", pa.float64()),
        pa.field("token_logprobs", pa.list_(pa.float32()), nullable=False),
    ]
)

SCHEMAS: Final[dict[str, pa.Schema]] = {
    "prompts": PROMPTS,
    "responses": RESPONSES,
    "tokens": TOKENS,
    "validation": VALIDATION,
    "hidden_states": HIDDEN_STATES_INDEX,
    SCORES_STAGE: SCORES,
}

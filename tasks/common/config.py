"""The one strict pipeline configuration: every knob has a unit in its name and a bound, unknown keys fail.

Secrets are `SecretStr` and are only ever unwrapped at the HTTP boundary (`EndpointConfig.resolved_api_key`);
`PipelineConfig.provenance()` and `public_dump()` are the only views that leave the process.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tasks.common.errors import ConfigError

DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def yaml_off(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads a bare `off` as false: in a setting whose values include "off", false means it."""
    return "off" if value is False else value


class StrictModel(BaseModel):
    # hide_input_in_errors: a validation error would otherwise quote the endpoint mapping, key included, into
    # Prefect's state message, logs and failure artifact.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, hide_input_in_errors=True)


class DatasetConfig(StrictModel):
    name: str
    path: Path
    file_format: Literal["auto", "jsonl", "parquet"] = "auto"
    shape: Literal["auto", "messages", "sharegpt"] = "auto"
    max_samples: int | None = Field(
        default=None,
        ge=1,
        description="Use the first N usable prompts of the file (in file order; malformed or duplicate rows do "
        "not count) and read no further: a smaller run, or one that fits endpoint.max_cost_usd.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not DATASET_NAME.match(v):
            raise ValueError(f"dataset name {v!r} must match {DATASET_NAME.pattern}")
        return v


class SamplingConfig(StrictModel):
    temperature: float = Field(default=0.6, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    max_tokens: int = Field(default=4096, ge=1, le=1_048_576)
    seed: int | None = Field(
        default=None, description="Sent as the request seed; sample k of a prompt is sent seed + k."
    )
    stop: list[str] | None = Field(
        default=None,
        description="Refused when not empty: an answer ended by a stop string is cut where the target did not end "
        "its turn, and an OpenAI-compatible answer does not say which ended it, so it would be stored with an "
        "end-of-turn the model never emitted.",
    )
    samples_per_prompt: int = Field(
        default=1, ge=1, le=256, description="Responses per prompt; each is its own sample_id (k=0 keeps the id)."
    )
    regenerate: Literal["final_turn", "every_turn"] = Field(
        default="final_turn",
        description="final_turn: answer the conversation's last user turn; every_turn: answer each user turn in "
        "order, with the target's own earlier answers as history.",
    )

    @field_validator("stop")
    @classmethod
    def _no_stop_strings(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise ValueError(
                "stop strings cut answers where the target did not end its turn, and the answer does not say "
                "whether a stop string or the end of turn ended it: each would be stored with an end-of-turn the "
                "model never emitted; remove sampling.stop (the model's own end of turn ends every answer)"
            )
        return v


class EndpointConfig(StrictModel):
    kind: Literal["openai_chat", "sglang_generate"] = "openai_chat"
    base_url: str = "http://127.0.0.1:30000"
    model: str
    api_key: SecretStr | None = None
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding the API key (read when api_key is not set)."
    )
    max_in_flight: int = Field(default=2000, ge=1, le=100_000)
    request_timeout_s: float = Field(default=900.0, gt=0)
    connect_timeout_s: float = Field(
        default=30.0, gt=0, description="Opening a connection; a request that never connected was never billed."
    )
    max_attempts: int = Field(default=6, ge=1, le=100)
    backoff_base_s: float = Field(
        default=1.0,
        ge=0,
        description="A sample's retry waits a random time up to this, doubling per attempt up to "
        "backoff_max_s (a Retry-After is honoured instead).",
    )
    backoff_max_s: float = Field(
        default=60.0, ge=0, description="The longest backoff between two attempts of a sample."
    )
    keep_length_truncated: bool = Field(
        default=False,
        description="Keep samples that ended with finish_reason=length (else: failed); validation then passes "
        "them too ('length' joins validation.allowed_finish_reasons): the one setting for truncated answers.",
    )
    logprobs: bool = Field(
        default=False,
        description="openai_chat: ask for per-token logprobs (`logprobs: true`) and rebuild the model's exact ids "
        "from their bytes (stored as output_ids); providers that return none are re-encoded as before.",
    )
    return_token_ids: bool = Field(
        default=False,
        description="openai_chat on vLLM: ask for the ids themselves (`return_token_ids: true`): the sampled "
        "`token_ids` are stored as output_ids (checked to spell the answer's text) and the `prompt_token_ids` the "
        "server rendered are the row's prompt; an endpoint that returns none (OpenRouter) is re-encoded.",
    )
    provider_routing: dict[str, Any] | None = Field(
        default=None, description="OpenRouter `provider` object (order, only, quantizations, ...)."
    )
    reasoning: dict[str, Any] | None = Field(
        default=None, description="OpenRouter `reasoning` object (effort, max_tokens, exclude)."
    )
    price_prompt_usd_per_mtok: float = Field(default=0.0, ge=0)
    price_completion_usd_per_mtok: float = Field(default=0.0, ge=0)
    commit_every_samples: int = Field(default=256, ge=1)
    commit_every_s: float = Field(default=10.0, gt=0)
    stream: bool = Field(
        default=True,
        description="openai_chat: Server-Sent Events (usage in the final chunk), the default there (unset: true for "
        "openai_chat, false for sglang_generate). The generation id arrives with the first chunk, so an answer cut "
        "off later can be settled from the provider's records, and a cancelled stream stops billing where the "
        "provider honours cancellation. false: one JSON body per request.",
    )
    stream_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="Streaming: a gap this long between two chunks is a timeout."
    )
    min_in_flight: int = Field(
        default=8,
        ge=1,
        description="Floor of the adaptive window (capped by max_in_flight): 429s shrink the window, "
        "healthy answers regrow it.",
    )
    max_cost_usd: float | None = Field(
        default=None,
        gt=0,
        description="Hard cap on the run directory's total spend; in-flight requests reserve their worst case.",
    )
    reconcile_cost: bool = Field(
        default=False,
        description="OpenRouter: fetch each generation's billed cost from /api/v1/generation?id=; also settles, in "
        "the spend ledger, attempts cut off after their generation id arrived (else counted at worst case).",
    )
    require_reasoning: bool = Field(
        default=False, description="An answer with empty reasoning is retried (reasoning models that must think)."
    )
    progress_every_s: float = Field(default=2.0, gt=0, description="How often progress listeners are called.")
    outage_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="Deprecated, accepted for old configs and not used: while the endpoint as a whole is down "
        "(the circuit breaker: outage_probe_min_s / outage_probe_max_s) no request is sent and no sample uses up "
        "an attempt, whatever the timings; outage_abort_s alone bounds an outage.",
    )
    outage_abort_s: float = Field(
        default=600.0,
        gt=0,
        description="After this long without any successful answer the run stops, resumably (EndpointUnavailable"
        "Error: the CLI exits 4; Prefect does not retry the task, the window is used up); nothing is marked "
        "failed for the outage. The pre-flight endpoint probe waits the same window.",
    )
    outage_probe_min_s: float = Field(
        default=0.5, gt=0, description="While the endpoint is down: the first liveness probe's delay (it doubles)."
    )
    outage_probe_max_s: float = Field(
        default=30.0,
        gt=0,
        description="While the endpoint is down no request is sent; one probe at a time decides when sending "
        "resumes, backing off to this interval.",
    )
    settle_pending: bool = Field(
        default=True,
        description="openai_chat with prices: attempts that ended pending with a generation id (a cut stream, a "
        "kill) are settled from GET /api/v1/generation?id= at the start and end of each run. Off: they stay at "
        "their worst case until the account settles them.",
    )
    account_settlement: Literal["off", "exclusive_key"] = Field(
        default="off",
        description="exclusive_key: the API key is used by this run directory alone while it runs, so the key's "
        "usage (GET /api/v1/key) before and after a run, minus what is known billed, is what its pending attempts "
        "cost; they are settled from that difference. off (a shared key): pending attempts stay at their worst "
        "case, counted against the cap, and their amount is printed.",
    )
    account_settle_stable_s: float = Field(
        default=5.0,
        ge=0,
        description="exclusive_key: the key's usage must stay unchanged this long (and cover every answer billed "
        "so far) before a reading counts; longer than the provider's usage update interval.",
    )
    account_settle_wait_s: float = Field(
        default=120.0,
        ge=0,
        description="exclusive_key: how long a run waits, at its start and end, for the key's usage to settle; "
        "past it the reading is kept but settles nothing, and pending attempts stay at worst case.",
    )
    retry_failed: Literal["transient", "all"] = Field(
        default="transient",
        description="Which committed failed samples a rerun sends again: 'transient' (and budget/outage stops), "
        "plus deterministic failures (length, context length, content filter, 4xx) only when the settings that "
        "caused them changed; 'all' resends every failed sample (CLI: --retry-failed all).",
    )
    journal_group_commit_s: float = Field(
        default=0.2,
        gt=0,
        le=10,
        description="Journaled answers and spend records are fsynced at least this often (what a machine crash can "
        "lose); they reach the kernel every 20 ms, so a kill -9 loses only what was in flight or just received.",
    )
    disk_reserve_mib: float | None = Field(
        default=None,
        ge=0,
        description="Space generate claims in the run directory when it starts and frees when the disk fills, so "
        "the answers in flight then (already billed) are journaled, not lost: it stops sending, keeps them and "
        "exits 2. Unset: max_in_flight x min(sampling.max_tokens, 8192) x 8 bytes, within 16-256 MiB; 0: none.",
    )
    spill_dir: Path | None = Field(
        default=None,
        description="Where generate writes the answers and spend records that the run directory's disk could not "
        "take when it failed mid-run (EIO, a read-only remount, a stale network mount), for the next run to take "
        "back; choose a folder on another disk. Unset: eagle3-datagen-spill-<uid> in the system's temporary directory.",
    )

    @model_validator(mode="before")
    @classmethod
    def _stream_default(cls, data: Any) -> Any:
        """Streaming is the default of openai_chat only: SGLang's /generate answers in one body."""
        if isinstance(data, dict) and data.get("stream") is None:
            data = {**data, "stream": data.get("kind", "openai_chat") == "openai_chat"}
        return data

    @field_validator("account_settlement", mode="before")
    @classmethod
    def _settlement_off(cls, v: Any) -> Any:
        return yaml_off(v)

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be http(s), got {v!r}")
        return v.rstrip("/")

    def resolved_api_key(self) -> str | None:
        """The only place a key is unwrapped; callers put it straight into a request header."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise ConfigError(f"endpoint.api_key_env names {self.api_key_env!r}, which is unset or empty")
            return value
        return None


COMPLETION_FORMAT_NAMES: frozenset[str] = frozenset(
    {
        "deepseek_v31_instruct",
        "deepseek_v31_thinking",
        "deepseek_v32_instruct",
        "deepseek_v32_thinking",
        "deepseek_v4_instruct",
        "deepseek_v4_thinking",
        "gpt_oss_harmony",
        "kimi_k25_instruct",
        "kimi_k25_thinking",
        "kimi_k2_instruct",
        "kimi_k2_thinking",
        "qwen3_2507_thinking",
        "qwen3_instruct",
        "qwen3_thinking",
    }
)
"""The names of `tasks.reconstruct.completion_format.PRESETS`, so a config names a known format when it is loaded:
that module imports transformers (seconds), and config loading reports a typo at once
(tests/test_config_completion_format.py keeps the two equal)."""


def format_fields_problem(
    reasoning_open: str | None,
    reasoning_close: str | None,
    open_in_prompt: bool,
    reasoning_pad: str,
    omit_empty_reasoning: bool = False,
    model_writes_pad: bool = False,
    empty_reasoning_close_only: bool = False,
    empty_reasoning_close_tail: str = "",
) -> str | None:
    """What makes a completion format's reasoning fields inconsistent, or None: checked where a format is written
    in the config (at load, without importing transformers) and where any format is built. An answer can only
    leave the think block out where the model is the one that opens it."""
    if (reasoning_open is None) != (reasoning_close is None):
        return "reasoning_open and reasoning_close go together"
    if reasoning_open is None and (open_in_prompt or reasoning_pad or omit_empty_reasoning):
        return "open_in_prompt / reasoning_pad / omit_empty_reasoning set on a format without reasoning"
    if omit_empty_reasoning and open_in_prompt:
        return "omit_empty_reasoning with open_in_prompt: the generation prompt already opened the block"
    if empty_reasoning_close_only and (reasoning_open is None or open_in_prompt or omit_empty_reasoning):
        return "empty_reasoning_close_only needs reasoning, a prompt that opens no block, and no omit_empty_reasoning"
    if empty_reasoning_close_tail and not (
        empty_reasoning_close_only
        and reasoning_close is not None
        and reasoning_close.endswith(empty_reasoning_close_tail)
        and reasoning_close != empty_reasoning_close_tail
    ):
        return (
            "empty_reasoning_close_tail needs empty_reasoning_close_only and must be a shorter end of reasoning_close"
        )
    if model_writes_pad and not (open_in_prompt and reasoning_pad):
        return (
            "model_writes_pad needs open_in_prompt and a reasoning_pad: it says who writes the pad after the open tag"
        )
    return None


class CompletionFormatSpec(StrictModel):
    """A completion format written out in the config, for a model no preset fits and whose chat template does not
    show the layout: SmolLM3, MiMo-VL, Ministral-3-Reasoning and Granite-3.3 reason with thinking on, but their
    templates never render reasoning, so `auto` can only derive a format without it. The literals are checked
    against the template wherever it shows them (end of turn always; every field when it renders reasoning), and
    their control tokens must each encode to one id, before anything is sent."""

    name: str = Field(default="custom", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    reasoning_open: str | None = Field(default=None, min_length=1, description="e.g. '<think>'; None: no reasoning.")
    open_in_prompt: bool = Field(default=False, description="The generation prompt already ends with the open tag.")
    reasoning_close: str | None = Field(default=None, min_length=1, description="e.g. '</think>'.")
    end_of_turn: str = Field(min_length=1, description="The control token that ends the turn, e.g. '<|im_end|>'.")
    reasoning_pad: str = Field(default="", description="Whitespace inside the tags on both sides of the reasoning.")
    content_separator: str = Field(default="", description="Text between the close tag and the content.")
    content_end: str = Field(
        default="",
        pattern=r"^(\s*|<\S*>)$",
        description="What the template writes between the content and end_of_turn: whitespace (Nemotron-Nano-v2: "
        "'\\n' before <SPECIAL_12>), or closing tags (Kimi-K3: '<|close|>response<|sep|><|close|>message<|sep|>' "
        "before <|end_of_msg|>).",
    )
    omit_empty_reasoning: bool = Field(
        default=False,
        description="An answer without reasoning is its content alone, with no empty think block (the template "
        "renders such an answer so, e.g. Bielik-11B-v3 with thinking off).",
    )
    empty_reasoning_close_only: bool = Field(
        default=False,
        description="An answer without reasoning is the close tag, separator and content, with no open tag (the "
        "template renders such an answer so, e.g. MiniMax-M3 in adaptive mode: '</mm:think>' then the content).",
    )
    empty_reasoning_close_tail: str = Field(
        default="",
        description="With empty_reasoning_close_only: the part of reasoning_close, from a control token to its end, "
        "that an answer without reasoning starts with, where the close ends by opening the answer's own message "
        "(gpt-oss: '<|channel|>final<|message|>' of '<|end|><|start|>assistant<|channel|>final<|message|>'); "
        "default: the whole close.",
    )
    model_writes_pad: bool = Field(
        default=False,
        description="With open_in_prompt: the generation prompt ends at the open tag and the model writes the "
        "reasoning_pad after it (poolside Laguna-XS.2: prompt '<think>', turns '<think>\\n...\\n</think>').",
    )
    control_tokens: tuple[str, ...] = Field(
        default=(),
        description="Control tokens inside the literals when a literal spans several; default: every token of the "
        "tokenizer's added-token table, or shaped like one (<...>, <|...|>), found in them.",
    )
    pinned_ids: dict[str, int] = Field(
        default_factory=dict, description="token -> id from the model's published tokenizer_config.json."
    )

    @field_validator("name")
    @classmethod
    def _not_a_preset(cls, v: str) -> str:
        if v in COMPLETION_FORMAT_NAMES or v in ("auto", "derived"):
            raise ValueError(f"a written-out completion format cannot be named {v!r}: that name is taken")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> CompletionFormatSpec:
        problem = format_fields_problem(
            self.reasoning_open,
            self.reasoning_close,
            self.open_in_prompt,
            self.reasoning_pad,
            self.omit_empty_reasoning,
            self.model_writes_pad,
            self.empty_reasoning_close_only,
            self.empty_reasoning_close_tail,
        )
        if problem:
            raise ValueError(f"completion_format: {problem}")
        return self


class TokenizerConfig(StrictModel):
    path: Path = Field(description="Local model directory (tokenizer files + chat template).")
    revision: str | None = Field(default=None, description="Recorded in provenance; a hash is computed too.")
    trust_remote_code: bool = False
    completion_format: str | CompletionFormatSpec = Field(
        default="auto", description="Preset name, 'auto' to derive it from the chat template, or written out."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Chat-template variables the server renders with (thinking, enable_thinking, reasoning_effort).",
    )

    @field_validator("completion_format")
    @classmethod
    def _known_format(cls, v: str | CompletionFormatSpec) -> str | CompletionFormatSpec:
        """A ConfigError, not a ValueError, passes through pydantic as it is: every command prints the same line
        `generate` prints when it resolves the format, and exits 2, before it reads a dataset or sends anything."""
        if isinstance(v, str) and v != "auto" and v not in COMPLETION_FORMAT_NAMES:
            raise ConfigError(
                f"unknown completion_format {v!r}; choose 'auto', one of {sorted(COMPLETION_FORMAT_NAMES)}, or write "
                "the format out (a mapping with end_of_turn, reasoning_open, ...)"
            )
        return v

    @property
    def completion_format_name(self) -> str:
        """The name messages, stats and Parquet rows carry."""
        fmt = self.completion_format
        return fmt if isinstance(fmt, str) else fmt.name


class ReconstructConfig(StrictModel):
    loss_on_reasoning: bool = Field(
        default=True,
        description="The drafter learns the reasoning tokens too (loss_mask 1); false trains on the content only. "
        "Reasoning is most of a thinking model's output, and its drafter drafts it.",
    )
    loss_on_end_of_turn: bool = Field(
        default=True,
        description="The drafter learns to draft the end-of-turn token (e.g. <|im_end|>) that closes each answer.",
    )
    token_ids: Literal["model", "reencode"] = Field(
        default="model",
        description="model: store the ids the endpoint reported the model generated (SGLang output_ids, vLLM "
        "token_ids, or ids rebuilt from logprobs bytes) wherever a response has them, re-encoding stays the check; "
        "reencode: always store the re-encoded text (what every row without model ids gets).",
    )
    repair_from: Path | None = Field(
        default=None,
        description="A run directory whose responses carry the model's ids (the same target through /generate or "
        "logprobs): rows here without ids of their own are re-encoded, then rewritten with the splits the model "
        "chose over the re-encoding's in those reference answers (token_source 'repaired').",
    )


class ValidationConfig(StrictModel):
    billing_tolerance_frac: float = Field(default=0.02, ge=0)
    max_real_difference_rate: float = Field(default=0.01, ge=0, le=1)
    max_failed_rate: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="Gate on a dataset's responses that failed after their retries for a reason the next run retries "
        "(transient, outage, budget) / responses; `generate` and `run` exit 5 above it.",
    )
    max_deterministic_failed_rate: float = Field(
        default=0.10,
        ge=0,
        le=1,
        description="Gate on a dataset's deterministic failures (context length, content filter, other 4xx, length) "
        "/ responses: a rerun with the same settings never sends them again, so they are gated apart.",
    )
    allowed_finish_reasons: list[str] = Field(default_factory=lambda: ["stop"])
    max_bpe_artifact_rate: float = Field(default=1.0, ge=0, le=1, description="Gate over referenced samples.")
    max_fail_verdict_rate: float = Field(default=1.0, ge=0, le=1, description="Gate over validated samples.")
    max_billing_delta_frac: float | None = Field(
        default=None, ge=0, description="Gate on |billed - ours| / ours of a dataset's completion tokens."
    )
    max_billing_flagged_rate: float = Field(default=1.0, ge=0, le=1, description="Gate on rows beyond tolerance.")
    fail_on_mixed_providers: bool = Field(
        default=False, description="Gate: a dataset served by more than one provider/quantization."
    )
    format_disagreement: Literal["fail", "warn"] = Field(
        default="fail", description="A completion_format preset the chat template contradicts: fail, or warn."
    )
    prompt_tolerance_tokens: int = Field(
        default=1,
        ge=0,
        description="|usage.prompt_tokens - rebuilt prompt length| up to this is 'within_tolerance' (a provider "
        "counting BOS differently); beyond it the row is 'drift' (the provider saw another prompt).",
    )
    max_prompt_drift_rate: float = Field(
        default=0.01, ge=0, le=1, description="Gate: rows in prompt-token drift, over rows whose usage has them."
    )
    empty_reasoning: Literal["fail", "warn"] = Field(
        default="fail",
        description="Thinking formats: an answer with no reasoning (hidden by the provider, or reasoning.exclude) "
        "fails the sample, or only warns.",
    )
    tool_call_policy: Literal["fail", "keep", "drop"] = Field(
        default="fail",
        description="Tool-call markup of any supported family in an answer (no tools are sent): fail the sample, "
        "keep it (a warning), or drop it from extraction without counting it as a failure.",
    )
    whitespace_min_samples: int = Field(
        default=50, ge=1, description="Answers a provider needs before its boundary-whitespace statistics count."
    )


class ExtractConfig(StrictModel):
    enabled: bool = True
    backend: Literal["hf", "sglang"] = "hf"
    model_path: Path | None = Field(default=None, description="Defaults to tokenizer.path.")
    layers: list[int] | None = Field(
        default=None, description="0-based decoder-layer outputs; default [1, N//2-1, N-4]."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    device: str = Field(default="auto", description="hf backend: auto, cpu, cuda or cuda:N.")
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | None = Field(
        default=None, description="hf backend: spread the model's layers over all visible GPUs (accelerate)."
    )
    tp_size: int = Field(default=1, ge=1, description="sglang backend: tensor-parallel ranks (GPUs).")
    sglang_mem_fraction_static: float = Field(
        default=0.8, gt=0, lt=1, description="sglang backend: GPU memory fraction for weights + KV pool."
    )
    max_tokens_per_batch: int = Field(default=8192, ge=1)
    max_shard_bytes: int = Field(default=2 * 1024**3, ge=1024)
    skip_failed_validation: bool = Field(
        default=True,
        description="Leave out of extraction (and so of training) the rows validation failed; false extracts them.",
    )
    store_final_state: bool = Field(
        default=True,
        description="False stores the 3 aux states only (25% less disk); trainers then recompute the target "
        "distribution themselves and the specforge/speculators exports refuse the run.",
    )


class ScoringConfig(StrictModel):
    """The target model scores its own training data at extraction (`tasks/extract/scores.py`): per answer token
    its log-probability and whether it was the target's top-1 choice; per sample the mean NLL, the top-1 rate,
    the longest run below `low_prob_floor` and the end token's log-probability. The bounds below judge samples
    (by reason, under `sample_policy`), the parity settings judge providers against each other
    (`tasks/scoring/`)."""

    enabled: bool = Field(
        default=True, description="Score every answer token with the target's own lm_head during extraction."
    )
    low_prob_floor: float = Field(
        default=1e-4,
        gt=0,
        lt=1,
        description="Tokens the target gives less than this probability count toward longest_low_prob_run "
        "(stored per sample: changing it recomputes the stored runs from the stored per-token log-probabilities).",
    )
    logits_chunk_tokens: int = Field(
        default=512,
        ge=1,
        description="Answer tokens whose full-vocabulary logits are on the device at once (memory: this x vocab x "
        "6 bytes, e.g. 0.5 GB for Kimi-K2.5's 163,840 entries).",
    )
    max_mean_nll_nats: float | None = Field(
        default=None, gt=0, description="Bound: a sample's mean negative log-likelihood per answer token (None: off)."
    )
    min_top1_rate: float | None = Field(
        default=None, ge=0, le=1, description="Bound: share of answer tokens that were the target's top-1 choice."
    )
    max_low_prob_run_tokens: int | None = Field(
        default=None, ge=1, description="Bound: longest run of answer tokens below low_prob_floor (garbage text)."
    )
    min_end_logprob: float | None = Field(
        default=None,
        le=0,
        description="Bound: the target's log-probability of the answer's last token (the end of turn): far below "
        "it, the answer stops where the target would not (a truncated tail).",
    )
    sample_policy: Literal["keep", "flag", "drop"] = Field(
        default="flag",
        description="Samples outside a bound: keep (counted in the report), flag (also listed in the export "
        "manifest), drop (left out of the exports). The report counts them by reason in every case.",
    )
    parity_gate: Literal["off", "warn", "fail"] = Field(
        default="warn",
        description="A provider whose answers the target scores worse than the other providers' beyond a margin: "
        "off, warn (named in the report, the artifact and the log), fail (also exit 5).",
    )
    parity_margin_nll_nats: float = Field(
        default=0.05, ge=0, description="Mean NLL per answer token a provider may exceed the others' by."
    )
    parity_margin_top1_rate: float = Field(
        default=0.02, ge=0, le=1, description="Top-1 agreement rate a provider may fall short of the others' by."
    )
    parity_confidence: float = Field(
        default=0.99,
        gt=0.5,
        lt=1,
        description="One-sided confidence that a difference exceeds its margin before a provider is named.",
    )
    parity_min_samples: int = Field(
        default=30, ge=2, description="Scored samples a provider (and the rest) need before it can be named."
    )

    @field_validator("parity_gate", mode="before")
    @classmethod
    def _gate_off(cls, v: Any) -> Any:
        return yaml_off(v)

    def bounds(self) -> dict[str, float | int | None]:
        return {
            "max_mean_nll_nats": self.max_mean_nll_nats,
            "min_top1_rate": self.min_top1_rate,
            "max_low_prob_run_tokens": self.max_low_prob_run_tokens,
            "min_end_logprob": self.min_end_logprob,
        }


def scores_extracted_with(scoring_enabled: bool, backend: str, store_final_state: bool) -> bool:
    """Scoring on, and a backend that can score: the sglang backend scores the stored final states after each
    part, so an sglang run that stores aux states only has nothing to score (the report says so)."""
    return scoring_enabled and (backend != "sglang" or store_final_state)


class PipelineConfig(StrictModel):
    run_dir: Path
    samples_per_shard: int = Field(default=1000, ge=1)
    datasets: list[DatasetConfig] = Field(min_length=1)
    endpoint: EndpointConfig
    sampling: SamplingConfig = SamplingConfig()
    tokenizer: TokenizerConfig
    reconstruct: ReconstructConfig = ReconstructConfig()
    validation: ValidationConfig = ValidationConfig()
    extract: ExtractConfig = ExtractConfig()
    scoring: ScoringConfig = ScoringConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> PipelineConfig:
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"dataset names must be unique, repeated: {dupes}")
        if self.extract.layers is not None and len(self.extract.layers) != 3:
            raise ValueError(f"extract.layers must name exactly 3 layers (low, mid, high), got {self.extract.layers}")
        ep = self.endpoint
        if ep.backoff_max_s < ep.backoff_base_s:
            raise ValueError("endpoint.backoff_max_s must be >= endpoint.backoff_base_s")
        if ep.max_cost_usd is not None and ep.price_completion_usd_per_mtok == 0:
            raise ValueError(
                "endpoint.max_cost_usd needs endpoint.price_prompt_usd_per_mtok and price_completion_usd_per_mtok: "
                "the cap reserves each in-flight request's worst-case cost before sending it"
            )
        if ep.stream and ep.kind != "openai_chat":
            raise ValueError("endpoint.stream applies to openai_chat endpoints only")
        if ep.reconcile_cost and ep.kind != "openai_chat":
            raise ValueError("endpoint.reconcile_cost reads OpenRouter's /generation records: openai_chat only")
        if ep.logprobs and ep.kind != "openai_chat":
            raise ValueError("endpoint.logprobs applies to openai_chat endpoints (sglang_generate returns output_ids)")
        if ep.return_token_ids and ep.kind != "openai_chat":
            raise ValueError(
                "endpoint.return_token_ids applies to openai_chat endpoints (sglang_generate returns output_ids)"
            )
        return self

    @property
    def allowed_finish_reasons(self) -> list[str]:
        """What validation accepts: `validation.allowed_finish_reasons`, plus "length" when generate keeps
        truncated answers (`endpoint.keep_length_truncated`), so keeping them cannot fail them silently later."""
        allowed = list(self.validation.allowed_finish_reasons)
        if self.endpoint.keep_length_truncated and "length" not in allowed:
            allowed.append("length")
        return allowed

    @property
    def scores_extracted(self) -> bool:
        """Whether extraction scores the answers (`scores_extracted_with`)."""
        return self.extract.enabled and scores_extracted_with(
            self.scoring.enabled, self.extract.backend, self.extract.store_final_state
        )

    @property
    def extract_model_path(self) -> Path:
        return self.extract.model_path or self.tokenizer.path

    def public_dump(self) -> dict[str, Any]:
        """JSON-safe view with secrets masked, for artifacts and provenance."""
        data = self.model_dump(mode="json")
        if data["endpoint"].get("api_key") is not None:
            data["endpoint"]["api_key"] = "**********"
        return data

    def provenance(self) -> dict[str, Any]:
        return {
            "model": self.endpoint.model,
            "endpoint_kind": self.endpoint.kind,
            "endpoint_base_url": self.endpoint.base_url,
            "sampling": self.sampling.model_dump(mode="json"),
            "tokenizer_path": str(self.tokenizer.path),
            "tokenizer_revision": self.tokenizer.revision,
        }


def _resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative paths in a YAML file are relative to that file, so configs can travel with their data."""

    def fix(value: Any) -> Any:
        if isinstance(value, str) and value and not Path(value).is_absolute():
            return str((base / value).resolve())
        return value

    data = dict(data)
    if "run_dir" in data:
        data["run_dir"] = fix(data["run_dir"])
    if isinstance(data.get("datasets"), list):
        data["datasets"] = [{**d, "path": fix(d.get("path"))} if isinstance(d, dict) else d for d in data["datasets"]]
    for section, key in (
        ("tokenizer", "path"),
        ("extract", "model_path"),
        ("reconstruct", "repair_from"),
        ("endpoint", "spill_dir"),
    ):
        if isinstance(data.get(section), dict) and data[section].get(key):
            data[section] = {**data[section], key: fix(data[section][key])}
    return data


def load_config(path: Path | str, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a YAML mapping, got {type(raw).__name__}")
    raw = _resolve_paths(raw, path.parent.resolve())
    return PipelineConfig.model_validate(apply_overrides(raw, typed_paths(overrides or {})))


def typed_paths(overrides: dict[str, Any], base: Path | None = None) -> dict[str, Any]:
    """Overrides with their relative paths made absolute against `base` (the current folder): typed on a
    command line (`--set run_dir=../runs/x`), a path means what the shell means by it. Left relative, `run_dir`
    printed relative and a later stage could resolve it elsewhere; resolved against the config's folder, as
    the YAML's own paths are, it wrote the run outside the folder the user was in."""
    folder = (base or Path.cwd()).resolve()
    out = {}
    for dotted, value in overrides.items():
        node: Any = _resolve_paths(apply_overrides({}, {dotted: value}), folder)
        for part in dotted.split("."):
            node = node[part]
        out[dotted] = node
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (`endpoint.max_in_flight`) in a copy of a raw config mapping."""
    out = copy.deepcopy(data)
    for dotted, value in overrides.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return out

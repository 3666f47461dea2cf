"""Request building and response parsing per endpoint kind, into one `GenerationResult`.

Two kinds, because they give different guarantees: an OpenAI-compatible chat API (OpenRouter, vLLM, SGLang's
OpenAI server) returns only text, so later stages must re-tokenize it; SGLang's native /generate takes the
exact prompt ids and returns the sampled `output_ids`, which are the ground truth the validator compares to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig
from tasks.common.errors import ConfigError, DatagenError
from tasks.common.messages import Message
from tasks.generate.token_bytes import ExactIds, LogprobTokens, exact_ids, reported_ids
from tasks.reconstruct.completion_format import CompletionFormat
from tasks.reconstruct.tokenizer_backend import backend_for
from tasks.reconstruct.tokenizer_loading import render_prompt_ids

CHAT_PATH = "/chat/completions"
GENERATE_PATH = "/generate"


class MalformedResponseError(DatagenError):
    """An HTTP 200 whose body is not the shape this endpoint kind promises; treated as retryable."""


@dataclass(frozen=True)
class CompletionMarkers:
    """Strings of the completion format: where reasoning ends, and the end-of-turn text a server may leave in.

    An empty `reasoning_close` means the format has no separate reasoning section. `fmt`, the whole format, lets
    ids rebuilt from logprobs be checked against the completion as reconstruct lays it out.
    """

    reasoning_close: str
    end_of_turn: str
    fmt: CompletionFormat | None = None

    @classmethod
    def of(cls, fmt: CompletionFormat) -> CompletionMarkers:
        return cls(*fmt.markers(), fmt=fmt)


@dataclass(frozen=True)
class EndpointRequest:
    url: str
    payload: dict[str, Any]
    prompt_ids: list[int] | None


@dataclass(slots=True)
class GenerationResult:
    """One answer as the endpoint reported it; `cost_usd` is what this attempt was billed (usage.cost or the
    price table), `billed_cost_usd` what OpenRouter's generation record says afterwards (reconciliation)."""

    reasoning: str | None
    content: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None
    cost_usd: float | None
    provider: str | None
    model: str | None
    generation_id: str | None
    output_ids: list[int] | None
    prompt_ids: list[int] | None
    quantization: str | None = None
    billed_cost_usd: float | None = None
    cost_unknown: bool = False
    """usage carried a cost that could not be read (`unreadable_cost`): pending, whatever the tokens price at"""
    cost_priced: bool = False
    """usage carried no cost: `cost_usd` is the configured price table's figure for its tokens, not a bill"""


def endpoint_url(cfg: PipelineConfig) -> str:
    """OpenAI-style base URLs end in /v1 (OpenRouter: .../api/v1); SGLang's /generate is at the root."""
    base = cfg.endpoint.base_url
    if cfg.endpoint.kind == "openai_chat":
        return base + CHAT_PATH if base.endswith("/v1") else base + "/v1" + CHAT_PATH
    return base.removesuffix("/v1") + GENERATE_PATH


def generation_lookup_url(cfg: PipelineConfig, generation_id: str) -> str:
    """OpenRouter's per-generation billing record: GET {base}/v1/generation?id= (base .../api for OpenRouter)."""
    base = cfg.endpoint.base_url
    base = base if base.endswith("/v1") else base + "/v1"
    return f"{base}/generation?id={generation_id}"


def request_seed(cfg: PipelineConfig, sample_index: int) -> int | None:
    """Sample k of a prompt is sent seed + k, so the samples differ and each is reproducible."""
    return None if cfg.sampling.seed is None else cfg.sampling.seed + sample_index


def build_request(
    cfg: PipelineConfig,
    messages: list[Message] | list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase | None = None,
    sample_index: int = 0,
) -> EndpointRequest:
    """The request for the `sample_index`-th response to these messages (its seed is `request_seed`)."""
    sampling = cfg.sampling
    seed = request_seed(cfg, sample_index)
    url = endpoint_url(cfg)
    if cfg.endpoint.kind == "openai_chat":
        payload: dict[str, Any] = {
            "model": cfg.endpoint.model,
            "messages": [_wire_message(m) for m in messages],
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "usage": {"include": True},
        }
        if cfg.endpoint.stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        if seed is not None:
            payload["seed"] = seed
        if cfg.endpoint.provider_routing:
            payload["provider"] = cfg.endpoint.provider_routing
        if cfg.endpoint.reasoning:
            payload["reasoning"] = cfg.endpoint.reasoning
        if cfg.tokenizer.chat_template_kwargs:
            payload["chat_template_kwargs"] = dict(cfg.tokenizer.chat_template_kwargs)
        if cfg.endpoint.logprobs:
            payload["logprobs"] = True
            payload["top_logprobs"] = 0
        if cfg.endpoint.return_token_ids:
            payload["return_token_ids"] = True
        return EndpointRequest(url, payload, None)
    if tokenizer is None:
        raise ConfigError("endpoint.kind 'sglang_generate' needs the tokenizer to render prompt ids")
    prompt_ids = render_prompt_ids(tokenizer, messages, cfg.tokenizer.chat_template_kwargs)  # type: ignore[arg-type]
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_new_tokens": sampling.max_tokens,
        "skip_special_tokens": False,
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return EndpointRequest(url, {"input_ids": prompt_ids, "sampling_params": params}, prompt_ids)


def _wire_message(message: Message | dict[str, Any]) -> dict[str, Any]:
    """Role and content, plus `reasoning` for the target's own earlier answers (every_turn history): OpenRouter
    passes it back to reasoning models, and servers that do not know the field ignore it."""
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    reasoning = message.get("reasoning")
    if message["role"] == "assistant" and reasoning:
        out["reasoning"] = reasoning
    return out


def pinned_quantization(cfg: PipelineConfig) -> str | None:
    """The quantization a request is pinned to (OpenRouter `provider.quantizations` naming exactly one)."""
    routing = cfg.endpoint.provider_routing or {}
    quants = routing.get("quantizations")
    if isinstance(quants, list) and len(quants) == 1 and isinstance(quants[0], str):
        return quants[0]
    return None


def price_cost(cfg: PipelineConfig, prompt_tokens: int | None, completion_tokens: int | None) -> float | None:
    """Cost from the configured price table; None when there is no table or no usage to price."""
    ep = cfg.endpoint
    if (ep.price_prompt_usd_per_mtok == 0 and ep.price_completion_usd_per_mtok == 0) or (
        prompt_tokens is None and completion_tokens is None
    ):
        return None
    return (
        (prompt_tokens or 0) * ep.price_prompt_usd_per_mtok
        + (completion_tokens or 0) * ep.price_completion_usd_per_mtok
    ) / 1e6


def usd_number(value: Any) -> float | None:
    """Dollars from a JSON number, or a string holding one (a proxy that writes decimals as strings: read as
    nothing, its answers were priced from the config while the provider billed a minimum fee, 1.5x the cap);
    None for anything else, and for an amount no bill can hold (NaN, infinite, negative: a NaN made the budget
    wait forever and the ledger's total NaN for good, a negative one let the spend pass the cap)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if not isinstance(value, int | float):
        return None
    amount = float(value)
    return amount if math.isfinite(amount) and amount >= 0 else None


def unreadable_cost(usage: Any) -> bool:
    """The usage carries a cost this client cannot read (`usd_number` is None for a value that is there): the
    answer's cost is unknown, pending until its generation record settles it, never priced from the config."""
    if not isinstance(usage, dict):
        return False
    details = usage.get("cost_details")
    values = [usage.get("cost"), details.get("upstream_inference_cost") if isinstance(details, dict) else None]
    return any(v is not None and usd_number(v) is None for v in values)


def reported_cost(usage: Any) -> float | None:
    """What the answer cost as the provider reported it (OpenRouter's usage accounting); None when absent.

    `usage.cost` is what OpenRouter charged the account. With the user's own provider key (`usage.is_byok`),
    that is only OpenRouter's fee: the inference itself, `cost_details.upstream_inference_cost`, was billed by
    the provider to the same user, so it is spent too and counts against the cap (a BYOK run recorded $0 while
    its provider charged 3x the cap). Without BYOK the upstream cost is already inside `cost`."""
    if not isinstance(usage, dict):
        return None
    cost = usd_number(usage.get("cost"))
    details = usage.get("cost_details")
    upstream = usd_number(details.get("upstream_inference_cost")) if isinstance(details, dict) else None
    if usage.get("is_byok") is True and upstream is not None:
        return (cost or 0.0) + upstream
    return cost


def parse_response(
    cfg: PipelineConfig,
    body: dict[str, Any],
    markers: CompletionMarkers,
    prompt_ids: list[int] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> GenerationResult:
    if cfg.endpoint.kind == "openai_chat":
        return _parse_chat(cfg, body, markers, tokenizer)
    return _parse_generate(cfg, body, markers, prompt_ids, tokenizer)


def _opt_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedResponseError(f"{what} must be an integer, got {value!r}")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise MalformedResponseError(f"{what} must be a string, got {type(value).__name__}")


def _model_ids(
    cfg: PipelineConfig,
    choice: dict[str, Any],
    reported: list[int] | None,
    reasoning: str | None,
    content: str | None,
    markers: CompletionMarkers,
    tokenizer: PreTrainedTokenizerBase | None,
) -> ExactIds | None:
    """The model's exact ids: the ids the endpoint `reported` (vLLM's `token_ids`), else rebuilt from the choice's
    logprobs bytes (`endpoint.logprobs`), when they cover the whole answer; the end-of-turn id is not among them
    (reconstruct adds it, as for a re-encoded row). Reported ids that do not spell the answer are still its
    reference (`_parse_chat`), as `/generate`'s `output_ids` are: the row is re-encoded, and validation classifies
    that re-encoding against the ids the model really generated."""
    if tokenizer is None:
        return None
    truncated = choice.get("finish_reason") == "length"
    close, eot, fmt = markers.reasoning_close, markers.end_of_turn, markers.fmt
    if reported:
        return reported_ids(reported, tokenizer, reasoning, content, close, eot, fmt, truncated)
    if not cfg.endpoint.logprobs:
        return None
    tokens = LogprobTokens()
    tokens.feed(choice.get("logprobs"))
    return exact_ids(tokens, tokenizer, reasoning, content, close, eot, fmt, truncated)


def _opt_ids(value: Any, what: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise MalformedResponseError(f"{what} must be a list of integers")
    return value


def _parse_chat(
    cfg: PipelineConfig,
    body: dict[str, Any],
    markers: CompletionMarkers | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> GenerationResult:
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedResponseError(f"chat response has no choices (keys: {sorted(body)})")
    choice, ep = choices[0], cfg.endpoint
    message = choice.get("message")
    if not isinstance(message, dict):
        raise MalformedResponseError("chat response choice has no message object")
    reasoning = message.get("reasoning")
    if reasoning is None or (reasoning == "" and message.get("reasoning_content")):  # "" must not hide it
        reasoning = message.get("reasoning_content")
    raw_usage = body.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    details = usage.get("completion_tokens_details")
    prompt_tokens = _opt_int(usage.get("prompt_tokens"), "usage.prompt_tokens")
    completion_tokens = _opt_int(usage.get("completion_tokens"), "usage.completion_tokens")
    cost = reported_cost(usage)
    unknown = cost is None and unreadable_cost(usage)
    priced = cost is None and not unknown
    if priced:
        cost = price_cost(cfg, prompt_tokens, completion_tokens)
    reasoning = _opt_str(reasoning, "message.reasoning")
    content = _opt_str(message.get("content"), "message.content")
    reported = _opt_ids(choice.get("token_ids"), "choices[0].token_ids") if ep.return_token_ids else None
    exact = _model_ids(cfg, choice, reported, reasoning, content, markers or CompletionMarkers("", ""), tokenizer)
    if exact is not None and exact.held_back:
        if content or not reasoning:
            content = (content or "") + exact.held_back
        else:
            reasoning += exact.held_back
    return GenerationResult(
        reasoning=reasoning,
        content=content,
        finish_reason=_opt_str(choice.get("finish_reason"), "finish_reason"),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        reasoning_tokens=_opt_int(
            details.get("reasoning_tokens") if isinstance(details, dict) else None, "usage.reasoning_tokens"
        ),
        cost_usd=cost,
        provider=_opt_str(body.get("provider"), "provider"),
        model=_opt_str(body.get("model"), "model"),
        generation_id=_opt_str(body.get("id"), "id"),
        output_ids=exact.ids if exact is not None else (reported or None),
        prompt_ids=_opt_ids(body.get("prompt_token_ids"), "prompt_token_ids") if ep.return_token_ids else None,
        quantization=_opt_str(body.get("quantization"), "quantization") or pinned_quantization(cfg),
        cost_unknown=unknown,
        cost_priced=priced and cost is not None,
    )


def split_completion(
    text: str,
    markers: CompletionMarkers,
    output_ids: list[int] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[str | None, str]:
    """(reasoning, content) of a raw completion text.

    The generation prompt of a reasoning format opens the reasoning section, so text with no close marker is
    reasoning that never finished (content ""), not content, unless the model answered without reasoning
    (`_unclosed`). With the model's `output_ids`, the end of turn and the close marker are where their control ids
    are: a model may write either as ordinary tokens (SmolLM2 asked to copy `<|im_end|>`, a thinking model
    explaining what `</think>` does), which is text it wrote, not a marker.
    """
    text = _without_end_of_turn(text, output_ids, markers, tokenizer)
    if not markers.reasoning_close:
        return None, text
    at = _close_at(text, output_ids, markers.reasoning_close, tokenizer)
    if at is None:
        at = text.find(markers.reasoning_close)
    if at < 0:
        return _unclosed(markers.fmt, text)
    return text[:at], text[at + len(markers.reasoning_close) :]


def _unclosed(fmt: CompletionFormat | None, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of text without the close marker: reasoning that never finished, unless the model
    answered without reasoning, which the text shows where it starts with the close's tail the format writes for
    such an answer (`empty_reasoning_close_tail`: gpt-oss opening its final channel at once), or where the format
    lets an answer leave the block out and the text does not start with the open tag."""
    tail = fmt.empty_reasoning_close_tail if fmt is not None else ""
    if tail and text.startswith(tail):
        return None, text[len(tail) :]
    if (
        fmt is not None
        and fmt.omit_empty_reasoning
        and not text.lstrip().startswith((fmt.reasoning_open or "").strip())
    ):
        return None, text
    return text, ""


def _without_end_of_turn(
    text: str, output_ids: list[int] | None, markers: CompletionMarkers, tokenizer: PreTrainedTokenizerBase | None
) -> str:
    """The text without the end-of-turn string a server kept (special tokens are not skipped). With the model's
    ids it is removed only when it is the end-of-turn id's text: the ids end with that id and the text is not
    just the other ids' text (a server that trims the stop token leaves model-written `<|im_end|>` characters
    last). Without ids the text cannot tell the two apart, and a trailing end-of-turn string is removed."""
    eot_text = markers.end_of_turn
    if not eot_text or not text.endswith(eot_text):
        return text
    eot = _control_id(tokenizer, eot_text)
    if output_ids is None or eot is None or tokenizer is None:
        return text[: -len(eot_text)]
    if output_ids[-1:] != [eot] or text == backend_for(tokenizer).decode(output_ids[:-1]):
        return text
    return text[: -len(eot_text)]


def _close_at(
    text: str, output_ids: list[int] | None, close: str, tokenizer: PreTrainedTokenizerBase | None
) -> int | None:
    """Where in `text` the reasoning-close control id's text starts, found from the model's ids: the first
    occurrence after as many as the model wrote as ordinary tokens before that id; -1 when the ids have no close
    id (the reasoning never finished). None where the ids cannot say (none, no tokenizer, no such control id, or
    a text that lacks that occurrence): the first occurrence in the text is taken then."""
    close_id = _control_id(tokenizer, close)
    if output_ids is None or close_id is None or tokenizer is None:
        return None
    if close_id not in output_ids:
        return -1
    written = backend_for(tokenizer).decode(output_ids[: output_ids.index(close_id)]).count(close)
    at = -1
    for _ in range(written + 1):
        at = text.find(close, at + 1)
        if at < 0:
            return None
    return at


def _ended_turn(
    output_ids: list[int] | None, markers: CompletionMarkers, tokenizer: PreTrainedTokenizerBase | None
) -> bool:
    """Whether a `/generate` answer reported as cut by length ended its turn: SGLang checks `max_new_tokens`
    before the stop token, so an answer whose last allowed token is the end of turn comes back as "length"
    with that id last in `output_ids`. It is a finished answer; laid out as a truncated one, the model's ids would
    not spell it and the row would fail. Only that id says so: a text ending in the end-of-turn string may be
    characters the model wrote, and without ids an end of turn would be invented."""
    eot = _control_id(tokenizer, markers.end_of_turn) if markers.end_of_turn else None
    return eot is not None and output_ids is not None and output_ids[-1:] == [eot]


def _control_id(tokenizer: PreTrainedTokenizerBase | None, token: str) -> int | None:
    """The id of a control token in the vocabulary, or None (no tokenizer, or the tokenizer does not know it)."""
    if tokenizer is None:
        return None
    found = tokenizer.convert_tokens_to_ids(token)
    return found if isinstance(found, int) and found != tokenizer.unk_token_id else None


def _parse_generate(
    cfg: PipelineConfig,
    body: dict[str, Any],
    markers: CompletionMarkers,
    prompt_ids: list[int] | None,
    tokenizer: PreTrainedTokenizerBase | None,
) -> GenerationResult:
    text = body.get("text")
    meta = body.get("meta_info")
    if not isinstance(text, str) or not isinstance(meta, dict):
        raise MalformedResponseError(f"/generate response needs 'text' and 'meta_info' (keys: {sorted(body)})")
    output_ids = _opt_ids(body.get("output_ids"), "/generate output_ids")
    finish = meta.get("finish_reason")
    finish_reason = finish.get("type") if isinstance(finish, dict) else finish
    if finish_reason == "length" and _ended_turn(output_ids, markers, tokenizer):
        finish_reason = "stop"
    reasoning, content = split_completion(text, markers, output_ids, tokenizer)
    prompt_tokens = _opt_int(meta.get("prompt_tokens"), "meta_info.prompt_tokens")
    completion_tokens = _opt_int(meta.get("completion_tokens"), "meta_info.completion_tokens")
    reasoning_tokens = _opt_int(meta.get("reasoning_tokens"), "meta_info.reasoning_tokens")
    if reasoning_tokens is None and output_ids and tokenizer is not None and markers.reasoning_close:
        close_id = _control_id(tokenizer, markers.reasoning_close)
        if close_id is not None and close_id in output_ids:
            reasoning_tokens = output_ids.index(close_id)
    generation_id = meta.get("id")
    return GenerationResult(
        reasoning=reasoning,
        content=content,
        finish_reason=_opt_str(finish_reason, "meta_info.finish_reason"),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        reasoning_tokens=reasoning_tokens,
        cost_usd=price_cost(cfg, prompt_tokens, completion_tokens),
        provider=None,
        model=cfg.endpoint.model,
        generation_id=None if generation_id is None else str(generation_id),
        output_ids=list(output_ids) if output_ids is not None else None,
        prompt_ids=prompt_ids,
    )

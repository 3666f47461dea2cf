"""Deterministic "target model" answers built from a real tokenizer, plus every knob of the simulator.

Why deterministic: tests and benchmarks must predict what the endpoint said for a prompt, and a rerun must see
the same answer. Everything derives from a hash of (prompt ids, request seed, config seed), never from global
randomness or time.

Why a real tokenizer: the pipeline's hard problem is reproducing the exact token ids a target model sampled
from the text an API returns. So the reference `output_ids` are what the model would emit: canonical BPE of
`reasoning </think> content` plus eos, except for a configurable fraction that is a *non-canonical* split of
the same bytes (what a sampling model really produces now and then), and an optional fraction whose ids encode
a slightly different text than the one returned (a real difference the validator must catch).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tasks.reconstruct.tokenizer_loading import tokenizer_hash

REASONING_CLOSE = "</think>"

# Words whose canonical BPE differs from naive splits (" NORTH" is one token, "NORTH" is "NOR"+"TH"), numbers,
# code, non-ASCII and punctuation-heavy tokens: the places where a re-tokenization goes wrong first.
_WORD_TEXT = """
    the a model token answer so we need to check compute value sum first then finally because
    therefore is of and in for with that NORTH NOR north SOUTH EAST WEST Paris London Tokyo Zürich
    Paris, 42 1024 3.14159 -7 2025 0x1F 1e-9 12,345 100% $19.99 x y f(x) == != <= -> => :: i++
    __init__ self.value snake_case camelCase std::vector<int> #include NaN None True null JSON
    HTTP/1.1 naïve café résumé 北京 東京 🙂 — “quoted” it's don't user's e.g.
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

CODE_SNIPPETS: tuple[str, ...] = (
    "def f(x):\n    return x * 2\n",
    "for i in range(10):\n    total += i\n",
    "int main(void) {\n    return 0;\n}\n",
    "const xs = [1, 2, 3].map((x) => x ** 2);\n",
    "SELECT name, COUNT(*) FROM users GROUP BY name;\n",
)

TOOLS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("get_weather", "city", ("Paris", "London", "Tokyo", "NORTH Pole")),
    ("search", "query", ("capital of France", "NOR gate truth table", "12,345 / 7")),
    ("calculator", "expression", ("3.14159 * 2", "(1024 - 7) / 3", "2 ** 10")),
)


FailureKind = Literal[
    "http",
    "context_length",
    "error_body",
    "finish_error",
    "finish_error_no_usage",
    "midstream_error",
    "late_error_body",
    "reset_before_done",
    "cut_after_finish",
    "truncated_json",
    "invalid_json",
    "empty",
    "empty_reasoning",
    "reset",
    "disconnect",
    "midstream_reset",
    "hang",
    "echo_key",
    "billed_http",
]


class FailureRule(BaseModel):
    """A deterministic slice of prompts that fails its first `attempts` requests (every request if None).

    Rules partition the prompt space: rule i owns the keys whose hash falls in its own `rate`-wide interval,
    so the fractions add up and a prompt is hit by at most one rule.

    Kinds are the ways a real API answer goes wrong, so a client can be tested against each one:
    "http" (status `status`, Retry-After `retry_after_s`), "context_length" (400), "error_body" (200 with an
    error object), "finish_error" (200, finish_reason "error", half the content, partial billing),
    "midstream_error" (SSE error chunk, stream ends without [DONE]), "late_error_body" (an error once generation
    began, as OpenRouter documents it: a 200 whose body is an error object, with the generation's id, half the
    content billed; a stream gets it as an error chunk), "reset_before_done" (a stream reset after its finish
    and usage chunks, before `[DONE]`; billed in full), "cut_after_finish" (a stream reset after its finish chunk,
    before the usage chunk: the whole answer, no bill in it; billed in full), "finish_error_no_usage" (as
    "finish_error", its body or stream without usage: an aborted generation, billed all the same),
    "truncated_json" (body or stream cut short),
    "invalid_json" (200 text/html), "empty" / "empty_reasoning" (200 with empty texts), "reset" (TCP RST, no
    response), "disconnect" (connection closed, no response), "midstream_reset" (TCP RST halfway through the
    body or stream), "hang" (stall `hang_s`), "echo_key" (400 whose message quotes the Authorization header),
    "billed_http" (the whole answer generated and billed, then HTTP `status` with an error body instead of it: a
    gateway's 524 or a 408 after the upstream finished; `X-Generation-Id` as `generation_id_header` says).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FailureKind = "http"
    status: int = Field(default=500, ge=400, le=599)
    rate: float = Field(ge=0.0, le=1.0)
    attempts: int | None = Field(default=1, ge=1)
    retry_after_s: float | None = Field(default=None, ge=0.0)
    hang_s: float = Field(default=30.0, ge=0.0)
    names_generation: bool = Field(
        default=False,
        description='"http": the error carries X-Generation-Id although nothing was generated or billed (no '
        'generation record is ever written); "error_body": the id too, and a record of $0 with no token',
    )


class SimConfig(BaseModel):
    """Every simulator knob. Lengths are in words; latency in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    model_name: str = "sim/deepseek-v4-sim"
    refuse_other_models: bool = Field(
        default=False,
        description="A chat request naming a model other than model_name gets OpenRouter's answer to a wrong model "
        "id: HTTP 400 '<model> is not a valid model ID' (left False, any name is answered).",
    )
    providers: tuple[str, ...] = ("SimProviderA", "SimProviderB")
    reasoning_words: tuple[int, int] = (20, 80)
    content_words: tuple[int, int] = (10, 60)
    tool_call_rate: float = Field(default=0.15, ge=0.0, le=1.0)
    code_rate: float = Field(default=0.2, ge=0.0, le=1.0)
    noncanonical_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    text_mismatch_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    report_cost: bool = True
    cost_encoding: Literal["number", "string", "nan", "negative"] = Field(
        default="number",
        description="How usage.cost is written (the bill is the real cost either way): a JSON number, a string "
        "holding it (a proxy that writes decimals as strings), NaN, or negated (a broken or hostile endpoint).",
    )
    # The shipped configs' prices (configs/run.yaml, flows/configs/demo.yaml): answers without usage.cost
    # (sglang_generate) are recorded at the config's prices, so the simulator bills the same.
    price_prompt_usd_per_mtok: float = Field(default=0.6, ge=0.0)
    price_completion_usd_per_mtok: float = Field(default=2.5, ge=0.0)
    failures: tuple[FailureRule, ...] = ()
    auth_fail_all: bool = False
    required_api_key: str | None = None
    latency_s: float = Field(default=0.0, ge=0.0)
    latency_lognormal: tuple[float, float] | None = Field(
        default=None, description="(mu, sigma) of log-seconds, added to latency_s."
    )
    cache_size: int = Field(default=65536, ge=1)
    unavailable_probes: int = Field(
        default=0, ge=0, description="The first N /health or /v1/models requests answer 503 (endpoint still starting)."
    )
    rate_limit_concurrency: int | None = Field(
        default=None, ge=1, description="More completion requests than this in flight: the extra ones get 429."
    )
    rate_limit_retry_after_s: float | None = Field(default=None, ge=0.0)
    generation_cost_factor: float = Field(
        default=1.0,
        ge=0.0,
        description="Billing drift: the provider bills this multiple of the usage.cost its answers report; its "
        "billing ledger, /api/v1/generation total_cost and the key's usage all show the bill.",
    )
    generation_lookup_delay_s: float = Field(
        default=0.0, ge=0.0, description="/api/v1/generation answers 404 until this long after completion."
    )
    generation_unsettled_s: float = Field(
        default=0.0,
        ge=0.0,
        description="/api/v1/generation answers 200 with a record of $0 and no tokens until this long after "
        "the lookup delay (a record still being written, taken for the bill by a careless client).",
    )
    generation_store_size: int = Field(default=200_000, ge=1)
    stream_chunk_delay_s: float = Field(
        default=0.0, ge=0.0, description="Pause between SSE chunks; 0 sends the whole stream at once."
    )
    injected_system_prompt: str | None = Field(
        default=None,
        description="Chat route: a provider-side default system prompt, rendered before a conversation that has "
        "none; usage.prompt_tokens counts it (what a client rebuilding the prompt never sees).",
    )
    boundary_whitespace_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Fraction of answers the model ends its reasoning with a newline in and starts its content "
        "with a blank line in (the reference ids hold them).",
    )
    account_usage_lag_s: float = Field(
        default=0.0, ge=0.0, description="GET /api/v1/key: usage counts what was billed at least this long ago."
    )
    key_limit_usd: float | None = Field(
        default=None,
        gt=0.0,
        description="The key's credit limit (GET /api/v1/key `limit`); once usage reaches it, completions get 402.",
    )
    generation_id_header: bool = Field(
        default=True,
        description="Chat answers carry X-Generation-Id (with a stream's headers, before any token); false: a "
        "stream's id arrives with its first chunk only.",
    )
    bill_cancelled: bool = Field(
        default=True,
        description="A client that goes away mid-generation is billed for the prompt and the tokens generated by "
        "then (OpenRouter bills a cancelled stream); false: it is not billed at all.",
    )
    byok_fee_fraction: float | None = Field(
        default=None,
        ge=0.0,
        description="Requests on the user's own provider key (BYOK): usage.cost is OpenRouter's fee (this fraction "
        "of the price), `cost_details.upstream_inference_cost` the price the provider bills, `is_byok` true; the "
        "bill records both (what the user paid; GET /api/v1/key counts both too, where OpenRouter's usage counts the "
        "fee alone). None: OpenRouter bills the price itself.",
    )
    strip_whitespace: bool = Field(
        default=False,
        description="Return reasoning and content stripped of leading/trailing whitespace, reference ids untouched "
        "(SGLang's reasoning parser before its PR #24251).",
    )

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        for name in ("reasoning_words", "content_words"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (min, max) with 0 <= min <= max, got {(lo, hi)}")
        total = sum(rule.rate for rule in self.failures)
        if total > 1.0 + 1e-9:
            raise ValueError(f"failure rule rates must sum to <= 1, got {total}")
        if not self.providers:
            raise ValueError("providers must name at least one provider")
        return self


@dataclass(frozen=True)
class SimSample:
    """The simulator's full answer to one (prompt, seed): what it returns and what the model "sampled"."""

    key: str
    prompt_ids: tuple[int, ...]
    reasoning: str
    content: str
    output_ids: tuple[int, ...]
    canonical_ids: tuple[int, ...]
    reasoning_tokens: int
    provider: str
    has_tool_call: bool
    noncanonical: bool
    text_mismatch: bool
    has_reasoning: bool = True
    finished: bool = True
    """The answer ends with its end-of-turn token (False: a model-backed decode stopped at its token cap)."""
    logprobs: tuple[float, ...] | None = None
    """Per output id, the model's log-probability of it (a model-backed answer); None: the stock generator, whose
    every token is certain (logprob 0)."""

    @property
    def text(self) -> str:
        return self.reasoning + REASONING_CLOSE + self.content if self.has_reasoning else self.content


def unit_hash(*parts: object) -> float:
    """A uniform number in [0, 1) from the parts: per-key decisions that do not depend on call order."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


_STANDARD_NORMAL = NormalDist()


def request_latency_s(config: SimConfig, key: str, attempt: int) -> float:
    """The latency the server sleeps before answering attempt `attempt` of `key` (= `Responder.key`).

    A pure function so a benchmark can tell, from outside, what the endpoint alone costs each request.
    """
    delay = config.latency_s
    if config.latency_lognormal is not None:
        mu, sigma = config.latency_lognormal
        u = min(max(unit_hash(key, attempt, config.seed, "latency"), 1e-12), 1 - 1e-12)
        delay += math.exp(mu + sigma * _STANDARD_NORMAL.inv_cdf(u))
    return delay


def scheduled_failure(config: SimConfig, key: str, attempt: int) -> FailureRule | None:
    """The failure rule attempt `attempt` of `key` gets, if any (pure, like `request_latency_s`)."""
    if not config.failures:
        return None
    u = unit_hash(key, config.seed, "failure")
    low = 0.0
    for rule in config.failures:
        if low <= u < low + rule.rate:
            return rule if rule.attempts is None or attempt <= rule.attempts else None
        low += rule.rate
    return None


def _rng(*parts: object) -> random.Random:
    return random.Random(int(unit_hash(*parts) * 2**53))


K = TypeVar("K")
V = TypeVar("V")


class _Lru(Generic[K, V]):
    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()


@dataclass(frozen=True)
class _LoadedTokenizer:
    tokenizer: PreTrainedTokenizerBase
    vocab: dict[str, int]
    special_ids: frozenset[int]


@lru_cache(maxsize=8)
def _load_tokenizer(model_dir: str, files_hash: str) -> _LoadedTokenizer:
    """One load per directory *content* (`files_hash`) and process: a 128k-token vocabulary takes ~1 s to load, a
    server is started per test or demo stage, and nothing here changes a tokenizer or its vocabulary once loaded."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    special = frozenset(tokenizer.all_special_ids) | frozenset(tokenizer.get_added_vocab().values())
    return _LoadedTokenizer(tokenizer, tokenizer.get_vocab(), special)


class Responder:
    """Maps a prompt to its deterministic `SimSample`; tokenizer work is cached per prompt key (LRU)."""

    def __init__(self, model_dir: Path | str, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        loaded = _load_tokenizer(str(Path(model_dir).resolve()), tokenizer_hash(Path(model_dir)))
        self.tokenizer: PreTrainedTokenizerBase = loaded.tokenizer
        eos = self.tokenizer.eos_token_id
        if not isinstance(eos, int):
            raise ValueError(f"{model_dir}: tokenizer needs an eos id (the end of an answer)")
        self.eos_id: int = eos
        self.eos_token: str = str(self.tokenizer.eos_token)
        # A tokenizer with a single `</think>` token answers in the thinking shape (reasoning, `</think>`, content);
        # any other answers with content only (an instruct model such as SmolLM2).
        close = self.tokenizer.convert_tokens_to_ids(REASONING_CLOSE)
        single = isinstance(close, int) and close != self.tokenizer.unk_token_id
        if single and self.tokenizer.encode(REASONING_CLOSE, add_special_tokens=False) != [close]:
            single = False
        self.reasoning_close_id: int | None = close if single and isinstance(close, int) else None
        self._vocab: dict[str, int] = loaded.vocab
        self._special_ids = loaded.special_ids
        self.close_is_special: bool = self.reasoning_close_id in self.tokenizer.all_special_ids
        self._prompts: _Lru[str, tuple[int, ...]] = _Lru(self.config.cache_size)
        self._samples: _Lru[str, SimSample] = _Lru(self.config.cache_size)

    def update_config(self, config: SimConfig) -> None:
        """New knobs change answers, so cached samples go; rendered prompts depend only on the injected system
        prompt."""
        if config.injected_system_prompt != self.config.injected_system_prompt:
            self._prompts.clear()
        self.config = config
        self._samples = _Lru(config.cache_size)
        self._prompts.size = config.cache_size

    def prompt_ids_for_messages(self, messages: list[dict[str, Any]]) -> tuple[int, ...]:
        cache_key = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        cached = self._prompts.get(cache_key)
        if cached is not None:
            return cached
        injected = self.config.injected_system_prompt
        if injected is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": injected}, *messages]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, expected str")
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        self._prompts.put(cache_key, ids)
        return ids

    def prompt_ids_for_text(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def key(self, prompt_ids: tuple[int, ...] | list[int], seed: int | None) -> str:
        digest = hashlib.sha256(array("q", prompt_ids).tobytes())
        digest.update(f"/{seed}".encode())
        return digest.hexdigest()[:24]

    def key_for_messages(self, messages: list[dict[str, Any]], seed: int | None = None) -> str:
        return self.key(self.prompt_ids_for_messages(messages), seed)

    def sample_for_messages(self, messages: list[dict[str, Any]], seed: int | None = None) -> SimSample:
        ids = self.prompt_ids_for_messages(messages)
        return self.sample(ids, seed)

    def sample(self, prompt_ids: tuple[int, ...], seed: int | None, key: str | None = None) -> SimSample:
        key = key or self.key(prompt_ids, seed)
        cached = self._samples.get(key)
        if cached is not None:
            return cached
        built = self._build(key, prompt_ids)
        self._samples.put(key, built)
        return built

    def decode(self, ids: list[int] | tuple[int, ...], skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def _build(self, key: str, prompt_ids: tuple[int, ...]) -> SimSample:
        cfg = self.config
        rng = _rng(key, cfg.seed, "text")
        reasoning = _paragraph(rng, rng.randint(*cfg.reasoning_words), cfg.code_rate)
        content = _paragraph(rng, rng.randint(*cfg.content_words), cfg.code_rate)
        thinking = self.reasoning_close_id is not None
        close = REASONING_CLOSE if thinking else ""
        if not thinking:
            reasoning = ""
        has_tool_call = unit_hash(key, cfg.seed, "tool") < cfg.tool_call_rate
        if has_tool_call:
            content = (content + "\n\n" if content else "") + _tool_call(rng)
        if thinking and unit_hash(key, cfg.seed, "whitespace") < cfg.boundary_whitespace_rate:
            reasoning, content = reasoning + "\n", "\n\n" + content
        provider = cfg.providers[int(unit_hash(key, cfg.seed, "provider") * len(cfg.providers))]
        canonical_body = self._encode(reasoning + close + content)
        canonical = (*canonical_body, self.eos_id)
        output_body = canonical_body
        text_mismatch = unit_hash(key, cfg.seed, "mismatch") < cfg.text_mismatch_rate
        if text_mismatch:
            altered = _alter(content, _rng(key, cfg.seed, "mismatch-word"))
            output_body = self._encode(reasoning + close + altered)
        noncanonical = False
        if unit_hash(key, cfg.seed, "noncanonical") < cfg.noncanonical_rate:
            split = self._split_one_token(output_body, _rng(key, cfg.seed, "noncanonical-pos"))
            if split is not None:
                output_body, noncanonical = split, True
        output = (*output_body, self.eos_id)
        if cfg.strip_whitespace:
            reasoning, content = reasoning.strip(), content.strip()
        return SimSample(
            key=key,
            prompt_ids=prompt_ids,
            reasoning=reasoning,
            content=content,
            output_ids=output,
            canonical_ids=canonical,
            reasoning_tokens=output.index(self.reasoning_close_id) if self.reasoning_close_id is not None else 0,
            provider=provider,
            has_tool_call=has_tool_call,
            noncanonical=noncanonical,
            text_mismatch=text_mismatch,
            has_reasoning=thinking,
        )

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def _split_one_token(self, ids: tuple[int, ...], rng: random.Random) -> tuple[int, ...] | None:
        """Replace one multi-byte token by two vocabulary tokens with the same bytes; None if none splits.

        Byte-level BPE vocab strings map one character to one byte, so splitting the string splits the bytes.
        The decode is checked anyway: a split that changed the text would be a real difference, not BPE noise.
        """
        tokens = self.tokenizer.convert_ids_to_tokens(list(ids))
        positions = [i for i, (t, tid) in enumerate(zip(tokens, ids, strict=True)) if tid not in self._special_ids]
        rng.shuffle(positions)
        reference = self.decode(ids)
        for pos in positions:
            token = tokens[pos]
            cuts = [
                (self._vocab[token[:k]], self._vocab[token[k:]])
                for k in range(1, len(token))
                if token[:k] in self._vocab and token[k:] in self._vocab
            ]
            if not cuts:
                continue
            left, right = rng.choice(cuts)
            candidate = (*ids[:pos], left, right, *ids[pos + 1 :])
            if self.decode(candidate) == reference:
                return candidate
        return None


def _paragraph(rng: random.Random, n_words: int, code_rate: float) -> str:
    out = ""
    remaining = n_words
    while remaining > 0:
        n = min(remaining, rng.randint(4, 14))
        remaining -= n
        words = [str(rng.randint(0, 99_999)) if rng.random() < 0.08 else rng.choice(WORDS) for _ in range(n)]
        sentence = " ".join(words) + rng.choice((".", ".", ".", "!", "?", ":"))
        out += (" " if out and not out.endswith("\n") else "") + sentence[0].upper() + sentence[1:]
        if remaining > 0 and rng.random() < code_rate / 3:
            out += "\n\n```\n" + rng.choice(CODE_SNIPPETS) + "```\n\n"
        elif remaining > 0 and rng.random() < 0.15:
            out += "\n\n"
    return out


def _tool_call(rng: random.Random) -> str:
    name, arg, values = rng.choice(TOOLS)
    payload = json.dumps({"name": name, "arguments": {arg: rng.choice(values)}}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def _alter(content: str, rng: random.Random) -> str:
    """A slightly different text: one word swapped (or one appended), as a provider-side edit would do."""
    words = content.split(" ")
    if len(words) < 2:
        return content + " NORTH"
    i = rng.randrange(len(words))
    replacement = rng.choice([w for w in WORDS if w != words[i]])
    return " ".join([*words[:i], replacement, *words[i + 1 :]])

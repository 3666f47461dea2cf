"""Every way an endpoint answer goes wrong, injected on demand by the simulator on 127.0.0.1, and what the generate
stage makes of it: retried to done, failed with a named reason, or the run stopped.

Each case runs against the non-streaming chat API, the streaming chat API and SGLang's /generate where it
applies. Failure schedules are deterministic per (prompt key, attempt), so prompts are picked to land in the
rule under test and per-row attempts, reasons and costs are asserted exactly.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from pydantic import SecretStr
from transformers import PreTrainedTokenizerBase

from endpoint_sim.responder import REASONING_CLOSE, FailureRule, Responder, SimConfig, scheduled_failure
from endpoint_sim.server import SimulatorServer
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, SamplingConfig, TokenizerConfig
from tasks.common.errors import EndpointUnavailableError, FatalEndpointError
from tasks.common.messages import prompt_messages, response_sample_id, sample_id
from tasks.common.schemas import PROMPTS
from tasks.common.shards import PartRef, read_part, write_part
from tasks.generate import CompletionMarkers, GenerateSummary, generate_parts, settlement
from tasks.generate.chunks import chunk_paths, read_chunk
from tasks.generate.client import OUTAGE_REASONS, EndpointClient, SampleOutcome
from tasks.reconstruct.tokenizer_loading import render_prompt_ids

EOS = "<｜end▁of▁sentence｜>"
MARKERS = CompletionMarkers(reasoning_close=REASONING_CLOSE, end_of_turn=EOS)
BASELINE = SimConfig()
SECRET = "sk-or-v1-FAILURE-TESTS-MUST-NOT-LEAK"
MODES = ("chat", "stream", "sglang")
CHAT_MODES = ("chat", "stream")
# Our price table for /generate (SGLang reports no cost); chat rows carry the simulator's usage.cost instead.
PRICE_PROMPT, PRICE_COMPLETION = 1.0, 3.0

Messages = list[dict[str, Any]]


def make_cfg(
    run_dir: Path, base_url: str, model_dir: Path, mode: str, sampling: SamplingConfig | None = None, **endpoint: Any
) -> PipelineConfig:
    settings: dict[str, Any] = {
        "base_url": base_url,
        "model": "sim/deepseek-v4-sim",
        "kind": "sglang_generate" if mode == "sglang" else "openai_chat",
        "stream": mode == "stream",
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "max_in_flight": 4,
        "commit_every_samples": 4,
        "price_prompt_usd_per_mtok": PRICE_PROMPT,
        "price_completion_usd_per_mtok": PRICE_COMPLETION,
        **endpoint,
    }
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="ds", path=model_dir)],
        endpoint=EndpointConfig(**settings),
        sampling=sampling or SamplingConfig(max_tokens=1024),
        tokenizer=TokenizerConfig(path=model_dir),
    )


def question(tag: str, i: int) -> Messages:
    return [{"role": "user", "content": f"[{tag}] question {i}: what lies NORTH of Paris?"}]


def write_prompts(run_dir: Path, conversations: list[Messages], samples_per_prompt: int = 1) -> list[dict[str, Any]]:
    """Part 0 of the prompts stage; sample k of a prompt has its own sample_id and sample_index k."""
    rows = []
    for i, messages in enumerate(conversations):
        prompt_id = sample_id("ds", messages)  # type: ignore[arg-type]
        for k in range(samples_per_prompt):
            rows.append(
                {
                    "sample_id": response_sample_id(prompt_id, k),
                    "dataset": "ds",
                    "source_file": "prompts.jsonl",
                    "source_row": i,
                    "messages": messages,
                    "prompt_id": prompt_id,
                    "sample_index": k,
                }
            )
    write_part(PartRef(run_dir, "prompts", 0), pa.Table.from_pylist(rows, schema=PROMPTS), provenance={})
    return rows


def run(cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase) -> GenerateSummary:
    tok = tokenizer if cfg.endpoint.kind == "sglang_generate" else None
    return generate_parts(cfg, [PartRef(cfg.run_dir, "prompts", 0)], MARKERS, tok)


def responses(run_dir: Path) -> dict[str, dict[str, Any]]:
    rows = read_part(PartRef(run_dir, "responses", 0)).to_pylist()
    assert len({r["sample_id"] for r in rows}) == len(rows), "a sample appears twice"
    return {r["sample_id"]: r for r in rows}


def committed_chunks(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {r["sample_id"]: r for path in chunk_paths(run_dir, 0) for r in read_chunk(path)}


def key_of(local: Responder, messages: Messages, seed: int | None = None) -> str:
    return local.key_for_messages([dict(m) for m in prompt_messages(messages)], seed)


def pick(local: Responder, config: SimConfig, tag: str, clean: int = 1, per_rule: int = 1) -> list[Messages]:
    """Questions chosen so each rule of `config` owns `per_rule` of them (in rule order), then `clean` unhit."""
    wanted = [per_rule] * len(config.failures) + [clean]
    chosen: list[list[Messages]] = [[] for _ in wanted]
    i = 0
    while any(len(c) < w for c, w in zip(chosen, wanted, strict=True)):
        messages = question(tag, i)
        i += 1
        rule = scheduled_failure(config, key_of(local, messages), 1)
        slot = len(config.failures) if rule is None else next(j for j, r in enumerate(config.failures) if r is rule)
        if len(chosen[slot]) < wanted[slot]:
            chosen[slot].append(messages)
    return [m for group in chosen for m in group]


def rule_of(sim: SimulatorServer, local: Responder, messages: Messages, seed: int | None = None) -> FailureRule | None:
    return scheduled_failure(sim.config, key_of(local, messages, seed), 1)


def expected_reason(rule: FailureRule, mode: str) -> str:
    """The retry/failure reason the client names for one injected failure kind."""
    if rule.kind == "http":
        return f"http_{rule.status}"
    if rule.kind in ("finish_error", "midstream_error"):
        if mode == "sglang":
            return "finish_abort"
        return "stream_error" if mode == "stream" and rule.kind == "midstream_error" else "finish_error"
    if rule.kind == "truncated_json":
        return "truncated_stream" if mode == "stream" else "invalid_json"
    return {
        "error_body": "error_body",
        "invalid_json": "invalid_json",
        "empty": "empty_response",
        "reset": "connection",
        "disconnect": "connection",
        "midstream_reset": "connection",
        "hang": "timeout",
    }[rule.kind]


def billed(sim: SimulatorServer, gen_id: str) -> float:
    """What the simulator billed one chat completion (its OpenRouter-style generation record)."""
    resp = httpx.get(f"{sim.base_url}/api/v1/generation", params={"id": gen_id}, timeout=10)
    resp.raise_for_status()
    return float(resp.json()["data"]["total_cost"])


def priced(prompt_tokens: int, completion_tokens: int) -> float:
    return (prompt_tokens * PRICE_PROMPT + completion_tokens * PRICE_COMPLETION) / 1e6


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


RETRIED_KINDS = (
    FailureRule(status=408, rate=0.0625, attempts=1),
    FailureRule(status=500, rate=0.0625, attempts=2),
    FailureRule(status=502, rate=0.0625, attempts=1),
    FailureRule(status=503, rate=0.0625, attempts=1),
    FailureRule(status=504, rate=0.0625, attempts=2),
    FailureRule(status=429, rate=0.0625, attempts=1),
    FailureRule(kind="error_body", rate=0.0625, attempts=1),
    FailureRule(kind="finish_error", rate=0.0625, attempts=1),
    FailureRule(kind="midstream_error", rate=0.0625, attempts=1),
    FailureRule(kind="truncated_json", rate=0.0625, attempts=1),
    FailureRule(kind="invalid_json", rate=0.0625, attempts=1),
    FailureRule(kind="empty", rate=0.0625, attempts=1),
    FailureRule(kind="reset", rate=0.0625, attempts=1),
    FailureRule(kind="disconnect", rate=0.0625, attempts=1),
    FailureRule(kind="midstream_reset", rate=0.0625, attempts=2),
)


@pytest.mark.parametrize("mode", MODES)
def test_retryable_failures_are_retried_to_the_true_answer(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    config = sim.update_config(failures=RETRIED_KINDS)
    conversations = pick(local, config, f"retry-{mode}", clean=2)
    rows = write_prompts(tmp_path, conversations)
    summary = run(make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode), tokenizer)
    got = responses(tmp_path)
    by_key = sim.stats()["by_key"]
    want_retries: Counter[str] = Counter()
    for row in rows:
        out, key = got[row["sample_id"]], key_of(local, row["messages"])
        rule = rule_of(sim, local, row["messages"])
        failed_attempts = rule.attempts or 0 if rule else 0
        if rule is not None:
            want_retries[expected_reason(rule, mode)] += failed_attempts
        sample = local.sample_for_messages(prompt_messages(row["messages"]))  # type: ignore[arg-type]
        assert out["status"] == "done" and out["failure_reason"] is None, (rule, out["error"])
        assert out["attempts"] == by_key[key] == failed_attempts + 1, rule
        # Never a partial answer: whatever failed before, the row holds the complete sample.
        assert (out["reasoning"], out["content"], out["finish_reason"]) == (sample.reasoning, sample.content, "stop")
        if mode == "sglang":
            prompt_len, length = len(out["prompt_ids"]), len(sample.output_ids)
            assert out["output_ids"] == list(sample.output_ids)
            partial = {"finish_error": length // 2, "midstream_error": length // 2, "empty": 0}
            extra = priced(prompt_len, partial[rule.kind]) if rule and rule.kind in partial else 0.0
            assert out["cost_usd"] == pytest.approx(priced(prompt_len, length) + extra)
        else:
            final = billed(sim, f"gen-{out['attempts']}-{key}")
            assert out["generation_id"] == f"gen-{out['attempts']}-{key}"
            # An answer that arrived whole but unusable carries usage: that failed attempt's cost stays on the row.
            # (A stream cut by an error chunk, a reset or a timeout never reports usage.)
            usage_billed = {"finish_error", "empty", *(("midstream_error",) if mode == "chat" else ())}
            if rule is not None and rule.kind in usage_billed:
                assert out["cost_usd"] == pytest.approx(billed(sim, f"gen-1-{key}") + final)
                assert out["cost_usd"] > final
            else:
                assert out["cost_usd"] == pytest.approx(final)
    total = summary.total()
    assert total["retries_by_reason"] == dict(want_retries)
    assert total["requests_sent"] == sum(r["attempts"] for r in got.values()) == sim.stats()["total_requests"]
    assert total["window_shrinks"] >= 1, "a 429 shrinks the window"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("status", "retry_after_s"), [(429, 0.2), (429, None), (402, 0.2)])
def test_rate_limit_answers_wait_and_shrink_the_window(
    mode: str,
    status: int,
    retry_after_s: float | None,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    sim.update_config(failures=(FailureRule(status=status, rate=1.0, attempts=1, retry_after_s=retry_after_s),))
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, min_in_flight=1)
    conversations = [question(f"rl-{mode}-{status}-{retry_after_s}", i) for i in range(4)]

    async def go() -> tuple[list[SampleOutcome], EndpointClient, float]:
        async with EndpointClient(cfg, MARKERS, tokenizer) as client:
            started = time.monotonic()
            outs = await asyncio.gather(*(client.generate(prompt_messages(m)) for m in conversations))
            return list(outs), client, time.monotonic() - started

    outcomes, client, elapsed = asyncio.run(go())
    for out, messages in zip(outcomes, conversations, strict=True):
        assert out.result is not None and out.reason is None
        assert (out.attempts, out.retry_reasons) == (2, [f"http_{status}"])
        assert out.result.content == local.sample_for_messages(prompt_messages(messages)).content  # type: ignore[arg-type]
    by_key = sim.stats()["by_key"]
    assert sorted(by_key.values()) == [2, 2, 2, 2]
    # All four were in flight together, so their four 429s are one signal: one shrink, not four.
    assert client.window.shrinks == 1 and client.window.limit < cfg.endpoint.max_in_flight
    if retry_after_s is not None:
        assert elapsed >= retry_after_s, "retried before the Retry-After had passed"


@pytest.mark.parametrize("mode", MODES)
def test_server_concurrency_cap_is_found_by_the_adaptive_window(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    cap, max_in_flight, samples = 3, 12, 60
    sim.update_config(rate_limit_concurrency=cap, latency_s=0.02)
    write_prompts(tmp_path, [question(f"cap-{mode}", i) for i in range(samples)])
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, max_in_flight=max_in_flight, min_in_flight=1)
    total = run(cfg, tokenizer).total()
    stats = sim.stats(with_keys=False)
    assert (total["done"], total["failed"]) == (samples, 0)
    assert stats["peak_in_flight"] <= cap and stats["rate_limited"] > 0
    assert total["window_shrinks"] > 0 and total["retries_by_reason"] == {"http_429": stats["rate_limited"]}
    # After the first round trip every refusal is a request sent over a limit that had not yet been shown too
    # high, and it halves the limit; only requests already in flight at a shrink may be refused without one.
    assert stats["rate_limited"] <= total["window_shrinks"] + max_in_flight
    assert stats["rate_limited"] < samples / 2


@pytest.mark.parametrize("mode", MODES)
def test_timeouts_are_retried_and_exhaust_max_attempts(
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Non-streaming: the whole-request timeout. Streaming: the first chunks arrive, then the stream stalls, and
    only the idle timeout can end it (the request timeout is far away). The stalled streams' bills are looked up
    at the run's end; how long that waits is not what this test is about."""
    monkeypatch.setattr(settlement, "LOOKUP_AFTER_RUN_S", (0.05,))
    config = sim.update_config(
        failures=(
            FailureRule(kind="hang", rate=0.4, attempts=1, hang_s=10.0),
            FailureRule(kind="hang", rate=0.4, attempts=None, hang_s=10.0),
        )
    )
    timeouts: dict[str, Any] = (
        {"stream_idle_timeout_s": 0.3, "request_timeout_s": 30.0} if mode == "stream" else {"request_timeout_s": 0.3}
    )
    rows = write_prompts(tmp_path, pick(local, config, f"hang-{mode}", clean=1))
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, max_attempts=2, **timeouts)
    total = run(cfg, tokenizer).total()
    got = responses(tmp_path)
    once, forever, clean = (got[r["sample_id"]] for r in rows)
    assert (once["status"], once["attempts"]) == ("done", 2)
    assert (forever["status"], forever["failure_reason"], forever["attempts"]) == ("failed", "timeout", 2)
    assert "gave up after 2 attempts" in forever["error"]
    assert (clean["status"], clean["attempts"]) == ("done", 1)
    assert total["retries_by_reason"] == {"timeout": 2}
    assert total["failures_by_reason"] == {"timeout": 1}


@pytest.mark.parametrize("mode", MODES)
def test_connection_refused_is_an_outage_that_fails_no_sample(
    mode: str, tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Nothing listens: the endpoint as a whole is down, so refused attempts use up nothing and the run stops
    resumably after outage_abort_s, with no failed row."""
    write_prompts(tmp_path, [question(f"refused-{mode}", i) for i in range(3)])
    cfg = make_cfg(
        tmp_path, f"http://127.0.0.1:{closed_port()}", tokenizer_dir, mode, max_attempts=2, outage_abort_s=0.5
    )
    with pytest.raises(EndpointUnavailableError, match=r"127\.0\.0\.1"):
        run(cfg, tokenizer)
    assert committed_chunks(tmp_path) == {} and not PartRef(tmp_path, "responses", 0).is_done()


@pytest.mark.parametrize("mode", MODES)
def test_retryable_failures_exhaust_max_attempts(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    forever = tuple(rule.model_copy(update={"attempts": None}) for rule in RETRIED_KINDS)
    config = sim.update_config(failures=forever)
    rows = write_prompts(tmp_path, pick(local, config, f"forever-{mode}", clean=1))
    total = run(make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, max_attempts=3), tokenizer).total()
    got, by_key = responses(tmp_path), sim.stats()["by_key"]
    want: Counter[str] = Counter()
    for row in rows:
        out, rule = got[row["sample_id"]], rule_of(sim, local, row["messages"])
        assert by_key[key_of(local, row["messages"])] == out["attempts"]
        if rule is None:
            assert (out["status"], out["attempts"]) == ("done", 1)
            continue
        reason = expected_reason(rule, mode)
        want[reason] += 1
        assert (out["status"], out["failure_reason"]) == ("failed", reason), rule
        # Outage-class failures three in a row open the breaker even though its probe answers (a provider's burst
        # of 503s): those that arrive while it is open are free, a failed trial request is not.
        free = out["attempts"] - 3
        assert free == 0 or (reason in OUTAGE_REASONS and 0 < free <= 3), (rule, out["attempts"])
        assert out["error"].startswith(f"gave up after {out['attempts']} attempts")
        assert out["content"] is None and out["reasoning"] is None, "a failed row carries no partial answer"
    assert total["failures_by_reason"] == dict(want)


@pytest.mark.parametrize("kind", ["midstream_error", "truncated_json"])
def test_a_trial_request_whose_stream_fails_as_its_own_sample_ends_the_trial(
    kind: str, tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path
) -> None:
    """While a provider fails every request with 503s and its liveness probe answers, one trial request at a time
    decides when sending resumes. A trial streamed 200 that then failed as its own sample's (an error chunk, a
    stream cut without a finish) ended neither in an answer nor in an outage-class failure, so the trial stayed
    taken: every sender, that sample's own retry included, waited for a trial nobody could take, and the run hung
    with the endpoint idle (seen once in `make test` as the [stream] case of the test above)."""
    rules = (FailureRule(status=503, rate=0.5, attempts=None), FailureRule(kind=kind, rate=0.5, attempts=None))
    config = sim.update_config(failures=rules)
    burst_a, burst_b, own, _ = pick(local, config, f"trial-{kind}", clean=0, per_rule=2)
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "stream", max_attempts=2, outage_probe_min_s=0.01)

    async def go() -> list[SampleOutcome]:
        async with EndpointClient(cfg, MARKERS) as client:
            outs = [await client.generate(prompt_messages(m)) for m in (burst_a, burst_b)]
            # Three 503s in a row while the probe answered: the breaker holds sends for one trial at a time.
            assert client.breaker.state in ("open", "trial")
            outs.append(await asyncio.wait_for(client.generate(prompt_messages(own)), timeout=30))
            return outs

    outcomes = asyncio.run(go())
    reason = expected_reason(rules[1], "stream")
    assert [o.reason for o in outcomes] == ["http_503", "http_503", reason]
    assert outcomes[2].attempts == 2 and sim.stats()["by_key"][key_of(local, own)] == 2


@pytest.mark.parametrize("mode", CHAT_MODES)
def test_empty_reasoning_is_kept_unless_reasoning_is_required(
    mode: str, tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path
) -> None:
    sim.update_config(failures=(FailureRule(kind="empty_reasoning", rate=1.0, attempts=1),))
    for require, tag in ((False, "keep"), (True, "require")):
        run_dir = tmp_path / tag
        rows = write_prompts(run_dir, [question(f"noreason-{mode}-{tag}", i) for i in range(3)])
        cfg = make_cfg(run_dir, sim.base_url, tokenizer_dir, mode, require_reasoning=require)
        total = generate_parts(cfg, [PartRef(run_dir, "prompts", 0)], MARKERS).total()
        for row in rows:
            out = responses(run_dir)[row["sample_id"]]
            sample = local.sample_for_messages(prompt_messages(row["messages"]))  # type: ignore[arg-type]
            assert out["status"] == "done" and out["content"] == sample.content
            if require:
                assert (out["attempts"], out["reasoning"]) == (2, sample.reasoning)
            else:
                assert out["attempts"] == 1 and not out["reasoning"]
        assert total["retries_by_reason"] == ({"empty_reasoning": 3} if require else {})


@pytest.mark.parametrize("mode", MODES)
def test_length_truncation_fails_unless_kept(
    mode: str, tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_prompts(tmp_path, [question(f"length-{mode}", i) for i in range(3)])
    short = SamplingConfig(max_tokens=6)
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, sampling=short)
    assert run(cfg, tokenizer).total()["failures_by_reason"] == {"length": 3}
    for out in responses(tmp_path).values():
        assert (out["status"], out["failure_reason"], out["finish_reason"]) == ("failed", "length", "length")
        assert out["completion_tokens"] == 6 and "max_tokens=6" in out["error"] and out["attempts"] == 1
    keep = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, sampling=short, keep_length_truncated=True)
    assert run(keep, tokenizer).total()["done"] == 3
    for out in responses(tmp_path).values():
        assert (out["status"], out["finish_reason"], out["failure_reason"]) == ("done", "length", None)
    assert sim.stats(with_keys=False)["total_requests"] == 6


@pytest.mark.parametrize("mode", MODES)
def test_context_length_fails_once_and_a_rerun_sends_only_failures(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    config = sim.update_config(failures=(FailureRule(kind="context_length", rate=0.5, attempts=None),))
    rows = write_prompts(tmp_path, pick(local, config, f"ctx-{mode}", clean=3, per_rule=3))
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode)
    first = run(cfg, tokenizer).total()
    assert (first["done"], first["failed"], first["requests_sent"]) == (3, 3, 6)
    assert first["failures_by_reason"] == {"context_length": 3} and first["retries_by_reason"] == {}
    got, by_key = responses(tmp_path), sim.stats()["by_key"]
    failed = [r for r in rows if got[r["sample_id"]]["status"] == "failed"]
    assert failed == rows[:3]
    for row in rows:
        assert by_key[key_of(local, row["messages"])] == 1, "a context-length answer is never retried"
    for row in failed:
        out = got[row["sample_id"]]
        assert (out["failure_reason"], out["attempts"]) == ("context_length", 1)
        assert "maximum context length" in out["error"]

    sim.update_config(failures=())
    kept = run(cfg, tokenizer).total()
    assert (kept["requests_sent"], kept["kept_failed"]) == (0, 3), "a deterministic failure was bought again"
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, retry_failed="all")
    second = run(cfg, tokenizer).total()
    assert (second["requests_sent"], second["done"], second["skipped_already_done"]) == (3, 3, 3)
    after = sim.stats()["by_key"]
    for row in rows:
        assert after[key_of(local, row["messages"])] == 1 + (row in failed)
        assert responses(tmp_path)[row["sample_id"]]["status"] == "done"


FATAL_CASES = [
    ("chat", 401),
    ("stream", 401),
    ("sglang", 401),
    ("chat", 402),
    ("stream", 402),
    ("sglang", 402),
    ("chat", 403),
    ("chat", 404),
]


@pytest.mark.parametrize(("mode", "status"), FATAL_CASES)
def test_run_fatal_answers_stop_the_run_at_once(
    mode: str,
    status: int,
    tmp_path: Path,
    sim: SimulatorServer,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    if status == 401:
        sim.update_config(auth_fail_all=True)
    else:
        sim.update_config(failures=(FailureRule(status=status, rate=1.0, attempts=None),), latency_s=0.01)
    write_prompts(tmp_path, [question(f"fatal-{mode}-{status}", i) for i in range(40)])
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, api_key=SecretStr(SECRET))
    with pytest.raises(FatalEndpointError) as info:
        run(cfg, tokenizer)
    message = str(info.value)
    assert f"HTTP {status}" in message and "the run stops" in message
    assert ("base_url" if status == 404 else "api_key") in message
    assert SECRET not in message
    # No sample retried, no new request after the first refusal: at most the first window went out.
    assert sim.stats(with_keys=False)["total_requests"] <= cfg.endpoint.max_in_flight
    assert not PartRef(tmp_path, "responses", 0).is_done()


@pytest.mark.parametrize("mode", MODES)
def test_error_echoing_the_key_fails_the_sample_without_the_key(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    config = sim.update_config(failures=(FailureRule(kind="echo_key", rate=0.5, attempts=None),))
    rows = write_prompts(tmp_path, pick(local, config, f"echo-{mode}", clean=1, per_rule=2))
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, api_key=SecretStr(SECRET))
    total = run(cfg, tokenizer).total()
    assert (total["done"], total["failed"], total["requests_sent"]) == (1, 2, 3)
    got = responses(tmp_path)
    for row in rows[:2]:
        out = got[row["sample_id"]]
        assert (out["status"], out["failure_reason"], out["attempts"]) == ("failed", "http_400", 1)
        assert "Bearer ***" in out["error"], "the echoed header is in the error, redacted"
    table = read_part(PartRef(tmp_path, "responses", 0))
    assert SECRET not in str(table.to_pylist())
    assert SECRET[8:20] not in str(table.to_pylist())


@pytest.mark.parametrize("mode", MODES)
def test_budget_cap_stops_the_run_and_a_higher_cap_finishes_it(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    samples, cap = 20, 0.004
    # Our price table equals the simulator's, so what a request can cost and what it is billed agree (chat).
    prices = {"price_prompt_usd_per_mtok": 0.6, "price_completion_usd_per_mtok": 2.5}
    rows = write_prompts(tmp_path, [question(f"budget-{mode}", i) for i in range(samples)])
    sampling = SamplingConfig(max_tokens=600)
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, sampling=sampling, max_cost_usd=cap, **prices)
    first = run(cfg, tokenizer).total()
    kept = committed_chunks(tmp_path)
    spent = sum(r["cost_usd"] for r in kept.values())
    assert first["stopped"] == "budget" and not PartRef(tmp_path, "responses", 0).is_done()
    assert 0 < len(kept) < samples and {r["status"] for r in kept.values()} == {"done"}
    assert spent <= cap and first["run_dir_billed_usd"] == pytest.approx(spent)
    assert first["requests_sent"] == sim.stats(with_keys=False)["total_requests"] == len(kept)

    richer = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, sampling=sampling, max_cost_usd=1.0, **prices)
    second = run(richer, tokenizer).total()
    got = responses(tmp_path)
    assert second["stopped"] is None and second["skipped_already_done"] == len(kept)
    assert second["requests_sent"] == second["done"] == samples - len(kept)
    assert set(sim.stats()["by_key"].values()) == {1}, "no sample was sent twice"
    assert {r["status"] for r in got.values()} == {"done"} and len(got) == samples
    assert second["run_dir_billed_usd"] == pytest.approx(sum(r["cost_usd"] for r in got.values()))
    for row in rows:
        if row["sample_id"] in kept:
            assert got[row["sample_id"]]["generation_id"] == kept[row["sample_id"]]["generation_id"]


@pytest.mark.parametrize("mode", ["chat", "stream"])
def test_billed_cost_is_reconciled_from_the_generation_record(
    mode: str, tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    sim.update_config(generation_cost_factor=1.25, generation_lookup_delay_s=0.2)
    write_prompts(tmp_path, [question(f"reconcile-{mode}", i) for i in range(3)])
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, reconcile_cost=True)
    run(cfg, tokenizer)
    lookups = sim.stats(with_keys=False)["generation_lookups"]
    for out in responses(tmp_path).values():
        assert out["status"] == "done"
        assert out["billed_cost_usd"] == pytest.approx(out["cost_usd"] * 1.25)
    assert lookups["200"] == 3 and lookups["404"] >= 3, "the record appears late: 404s are retried"


def test_reconciliation_is_refused_for_sglang_generate(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path
) -> None:
    with pytest.raises(ValueError, match="reconcile_cost"):
        make_cfg(tmp_path, sim.base_url, tokenizer_dir, "sglang", reconcile_cost=True)


@pytest.mark.parametrize("mode", MODES)
def test_samples_of_one_prompt_get_their_own_seed_and_answer(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    k, seed = 3, 11
    conversations = [question(f"samples-{mode}", i) for i in range(2)]
    rows = write_prompts(tmp_path, conversations, samples_per_prompt=k)
    cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, sampling=SamplingConfig(seed=seed, max_tokens=1024))
    assert run(cfg, tokenizer).total()["done"] == len(conversations) * k
    got = responses(tmp_path)
    for messages in conversations:
        answers = set()
        for row in (r for r in rows if r["messages"] == messages):
            out = got[row["sample_id"]]
            sample = local.sample_for_messages(prompt_messages(messages), seed + row["sample_index"])  # type: ignore[arg-type]
            assert out["request_seed"] == seed + row["sample_index"]
            assert (out["reasoning"], out["content"]) == (sample.reasoning, sample.content)
            answers.add(out["content"])
        assert len(answers) == k, "every sample of a prompt is a different answer"


def conversation(tag: str, turns: int, system: bool = False) -> Messages:
    """`turns` user turns, each followed by some other model's stale answer that must not be sent."""
    messages: Messages = [{"role": "system", "content": "Answer briefly."}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"[{tag}] turn {t + 1}: what lies NORTH of Paris?"})
        messages.append({"role": "assistant", "content": f"stale answer {t + 1}"})
    return messages


def replay(local: Responder, messages: Messages, seed: int | None) -> tuple[list[dict[str, Any]], list[str]]:
    """What every_turn must send: the conversation's user turns with the simulator's own answers as history.

    Returns the final request's history and the simulator key of each turn's request."""
    history: list[dict[str, Any]] = []
    keys = []
    for m in messages:
        if m["role"] == "assistant":
            continue
        history.append({"role": m["role"], "content": m["content"], "reasoning": None, "generated": False})
        if m["role"] != "user":
            continue
        wire = [
            {"role": h["role"], "content": h["content"], **({"reasoning": h["reasoning"]} if h["reasoning"] else {})}
            for h in history
        ]
        keys.append(local.key_for_messages(wire, seed))
        answer = local.sample_for_messages(wire, seed)
        history.append(
            {"role": "assistant", "content": answer.content, "reasoning": answer.reasoning, "generated": True}
        )
    return history, keys


@pytest.mark.parametrize("mode", MODES)
def test_every_turn_feeds_the_targets_own_answers_back(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    seed = 3
    sim.update_config(failures=(FailureRule(status=503, rate=1.0, attempts=1),))
    conversations = [conversation(f"every-{mode}-a", 2), conversation(f"every-{mode}-b", 3, system=True)]
    rows = write_prompts(tmp_path, conversations)
    sampling = SamplingConfig(regenerate="every_turn", seed=seed, max_tokens=1024)
    total = run(make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, sampling=sampling), tokenizer).total()
    got, by_key = responses(tmp_path), sim.stats()["by_key"]
    for row, turns in zip(rows, (2, 3), strict=True):
        out = got[row["sample_id"]]
        history, keys = replay(local, row["messages"], seed)
        final = history.pop()
        assert out["status"] == "done" and out["request_seed"] == seed
        assert (out["content"], out["reasoning"]) == (final["content"], final["reasoning"])
        assert out["history"] == history, "history is what the last request sent, the target's answers marked"
        assert [h["generated"] for h in history if h["role"] == "assistant"] == [True] * (turns - 1)
        assert "stale answer" not in str(out["history"])
        assert out["attempts"] == 2 * turns, "each turn's request failed once and was retried"
        assert [by_key[key] for key in keys] == [2] * turns
        if mode == "sglang":
            wire = [{k: v for k, v in h.items() if k in ("role", "content")} for h in history]
            assert out["prompt_ids"] == render_prompt_ids(tokenizer, wire)  # type: ignore[arg-type]
    assert total["retries_by_reason"] == {"http_503": 5}


@pytest.mark.parametrize("mode", MODES)
def test_every_turn_failure_names_the_turn(
    mode: str,
    tmp_path: Path,
    sim: SimulatorServer,
    local: Responder,
    tokenizer_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    config = sim.update_config(failures=(FailureRule(kind="context_length", rate=0.5, attempts=None),))
    hit: dict[int, Messages] = {}
    i = 0
    while len(hit) < 3:
        messages = conversation(f"turnfail-{mode}-{i}", 2)
        i += 1
        _, keys = replay(local, messages, None)
        fails = tuple(scheduled_failure(config, key, 1) is not None for key in keys)
        hit.setdefault(fails.index(True) + 1 if any(fails) else 0, messages)
    rows = write_prompts(tmp_path, [hit[1], hit[2], hit[0]])
    sampling = SamplingConfig(regenerate="every_turn", max_tokens=1024)
    total = run(make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, sampling=sampling), tokenizer).total()
    got, by_key = responses(tmp_path), sim.stats()["by_key"]
    first, second, clean = (got[r["sample_id"]] for r in rows)
    assert (first["status"], first["failure_reason"], first["attempts"]) == ("failed", "context_length", 1)
    assert first["error"].startswith("turn 1 of 2: ")
    assert (second["status"], second["failure_reason"], second["attempts"]) == ("failed", "context_length", 2)
    assert second["error"].startswith("turn 2 of 2: ")
    assert (clean["status"], clean["attempts"]) == ("done", 2)
    _, first_keys = replay(local, hit[1], None)
    assert by_key[first_keys[0]] == 1 and first_keys[1] not in by_key, "turn 2 is never sent after turn 1 failed"
    assert total["failures_by_reason"] == {"context_length": 2}

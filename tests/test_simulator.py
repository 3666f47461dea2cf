"""The endpoint simulator over real HTTP on 127.0.0.1 with the real DeepSeek-V4 tokenizer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from endpoint_sim.__main__ import parse_args
from endpoint_sim.responder import REASONING_CLOSE, FailureRule, Responder, SimConfig
from endpoint_sim.server import SimState, SimulatorServer
from tasks.reconstruct.tokenizer_loading import render_prompt_ids

EOS = "<｜end▁of▁sentence｜>"
BASELINE = SimConfig()


def chat(sim: SimulatorServer, content: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{sim.base_url}/v1/chat/completions", json=body, timeout=30)


def expected(local: Responder, sim: SimulatorServer, content: str, seed: int | None = None) -> Any:
    local.update_config(sim.config)
    return local.sample_for_messages([{"role": "user", "content": content}], seed)


def test_chat_completion_has_openrouter_shape_and_billing(
    sim: SimulatorServer, local: Responder, tokenizer: PreTrainedTokenizerBase
) -> None:
    resp = chat(sim, "What is NORTH of Paris?", max_tokens=4096)
    assert resp.status_code == 200
    body = resp.json()
    sample = expected(local, sim, "What is NORTH of Paris?")
    assert body["id"].startswith("gen-")
    assert body["provider"] in BASELINE.providers
    assert body["model"] == BASELINE.model_name
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": sample.content, "reasoning": sample.reasoning}
    usage = body["usage"]
    prompt_ids = render_prompt_ids(tokenizer, [{"role": "user", "content": "What is NORTH of Paris?"}])
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == len(sample.output_ids)
    assert usage["total_tokens"] == len(prompt_ids) + len(sample.output_ids)
    reasoning_ids = tokenizer.encode(sample.reasoning, add_special_tokens=False)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == len(reasoning_ids)
    prices = (BASELINE.price_prompt_usd_per_mtok, BASELINE.price_completion_usd_per_mtok)
    assert usage["cost"] == pytest.approx((len(prompt_ids) * prices[0] + len(sample.output_ids) * prices[1]) / 1e6)


def test_generate_returns_text_with_close_marker_and_exact_ids(
    sim: SimulatorServer, local: Responder, tokenizer: PreTrainedTokenizerBase
) -> None:
    messages = [{"role": "user", "content": "Explain NOR gates."}]
    ids = render_prompt_ids(tokenizer, messages)  # type: ignore[arg-type]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4096, "skip_special_tokens": False}}
    resp = httpx.post(f"{sim.base_url}/generate", json=body, timeout=30)
    assert resp.status_code == 200
    out = resp.json()
    sample = expected(local, sim, "Explain NOR gates.")
    assert out["text"] == sample.reasoning + REASONING_CLOSE + sample.content
    assert EOS not in out["text"]
    assert out["output_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(out["output_ids"]) == out["text"] + EOS
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": tokenizer.eos_token_id}
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == len(out["output_ids"])
    chat_body = chat(sim, "Explain NOR gates.").json()
    message = chat_body["choices"][0]["message"]
    assert out["text"] == message["reasoning"] + REASONING_CLOSE + message["content"]
    by_text = httpx.post(
        f"{sim.base_url}/generate", json={"text": tokenizer.decode(ids), "sampling_params": {}}, timeout=30
    ).json()
    assert by_text["output_ids"] == out["output_ids"]


def test_seed_selects_the_answer(sim: SimulatorServer) -> None:
    first = chat(sim, "seeded prompt", seed=1).json()["choices"][0]["message"]
    again = chat(sim, "seeded prompt", seed=1).json()["choices"][0]["message"]
    other = chat(sim, "seeded prompt", seed=2).json()["choices"][0]["message"]
    assert first == again
    assert first != other


def test_max_tokens_truncates_with_length(sim: SimulatorServer, tokenizer: PreTrainedTokenizerBase) -> None:
    body = chat(sim, "truncate me", max_tokens=5).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["message"]["content"] == ""
    ids = render_prompt_ids(tokenizer, [{"role": "user", "content": "truncate me"}])
    gen = httpx.post(
        f"{sim.base_url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "skip_special_tokens": False}},
        timeout=30,
    ).json()
    assert gen["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(gen["output_ids"]) == 5
    assert gen["text"] == tokenizer.decode(gen["output_ids"])


def test_reference_ids_are_canonical_by_default(local: Responder, tokenizer: PreTrainedTokenizerBase) -> None:
    local.update_config(SimConfig())
    for i in range(20):
        sample = local.sample_for_messages([{"role": "user", "content": f"canonical {i}"}])
        canonical = [*tokenizer.encode(sample.text, add_special_tokens=False), tokenizer.eos_token_id]
        assert list(sample.output_ids) == canonical
        assert not sample.noncanonical and not sample.text_mismatch


def test_noncanonical_ids_decode_to_the_same_text(local: Responder, tokenizer: PreTrainedTokenizerBase) -> None:
    local.update_config(SimConfig(noncanonical_rate=1.0))
    samples = [local.sample_for_messages([{"role": "user", "content": f"split {i}"}]) for i in range(30)]
    assert sum(s.noncanonical for s in samples) >= 28
    for sample in samples:
        if not sample.noncanonical:
            continue
        canonical = [*tokenizer.encode(sample.text, add_special_tokens=False), tokenizer.eos_token_id]
        assert list(sample.output_ids) != canonical
        assert len(sample.output_ids) == len(canonical) + 1
        assert tokenizer.decode(list(sample.output_ids)) == sample.text + EOS
    local.update_config(SimConfig())


def test_text_mismatch_ids_encode_a_different_text(local: Responder, tokenizer: PreTrainedTokenizerBase) -> None:
    local.update_config(SimConfig(text_mismatch_rate=1.0))
    for i in range(10):
        sample = local.sample_for_messages([{"role": "user", "content": f"mismatch {i}"}])
        assert sample.text_mismatch
        assert tokenizer.decode(list(sample.output_ids)) != sample.text + EOS
    local.update_config(SimConfig())


def test_about_15_percent_of_contents_carry_a_raw_tool_call(local: Responder) -> None:
    local.update_config(SimConfig())
    samples = [local.sample_for_messages([{"role": "user", "content": f"tools {i}"}]) for i in range(300)]
    with_calls = [s for s in samples if s.has_tool_call]
    assert 0.08 < len(with_calls) / len(samples) < 0.25
    for sample in with_calls:
        assert "<tool_call>" in sample.content
        payload = sample.content.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0]
        call = json.loads(payload)
        assert set(call) == {"name", "arguments"}
    assert all("<tool_call>" not in s.content for s in samples if not s.has_tool_call)


def test_injected_http_failures_follow_the_attempt_schedule(sim: SimulatorServer) -> None:
    sim.update_config(failures=(FailureRule(status=500, rate=1.0, attempts=2),))
    assert [chat(sim, "schedule 500").status_code for _ in range(3)] == [500, 500, 200]
    sim.update_config(failures=(FailureRule(status=429, rate=1.0, attempts=1, retry_after_s=0.5),))
    limited = chat(sim, "schedule 429")
    assert limited.status_code == 429
    assert limited.headers["Retry-After"] == "0.5"
    assert chat(sim, "schedule 429").status_code == 200
    sim.update_config(failures=(FailureRule(status=503, rate=1.0, attempts=1),))
    unavailable = chat(sim, "schedule 503")
    assert unavailable.status_code == 503 and "Retry-After" not in unavailable.headers
    assert unavailable.json()["error"]["code"] == 503


def test_context_length_and_error_body_failures(sim: SimulatorServer) -> None:
    sim.update_config(failures=(FailureRule(kind="context_length", status=400, rate=1.0, attempts=None),))
    for _ in range(2):
        resp = chat(sim, "too long")
        assert resp.status_code == 400
        assert "maximum context length" in resp.json()["error"]["message"]
    sim.update_config(failures=(FailureRule(kind="error_body", rate=1.0, attempts=1),))
    first = chat(sim, "error body")
    assert first.status_code == 200 and "error" in first.json() and "choices" not in first.json()
    assert "choices" in chat(sim, "error body").json()


def test_auth_modes(sim: SimulatorServer) -> None:
    sim.update_config(auth_fail_all=True)
    assert chat(sim, "auth").status_code == 401
    sim.update_config(auth_fail_all=False, required_api_key="sk-sim-right")
    assert chat(sim, "auth").status_code == 401
    good = httpx.post(
        f"{sim.base_url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "auth"}]},
        headers={"Authorization": "Bearer sk-sim-right"},
        timeout=30,
    )
    assert good.status_code == 200


def test_failure_rules_partition_prompts(local: Responder) -> None:
    config = SimConfig(failures=(FailureRule(status=500, rate=0.3), FailureRule(status=503, rate=0.2)))
    local.update_config(config)
    state = SimState(local)
    keys = [local.key_for_messages([{"role": "user", "content": f"partition {i}"}]) for i in range(1000)]
    statuses = [rule.status if (rule := state.failure_rule(k, 1)) else None for k in keys]
    assert 0.25 < statuses.count(500) / 1000 < 0.35
    assert 0.15 < statuses.count(503) / 1000 < 0.25
    assert all(state.failure_rule(k, 2) is None for k in keys)
    local.update_config(SimConfig())


def test_latency_draws_are_deterministic(local: Responder) -> None:
    local.update_config(SimConfig(latency_s=0.01, latency_lognormal=(-3.0, 0.5)))
    state = SimState(local)
    assert state.latency("k", 1) == state.latency("k", 1) > 0.01
    assert state.latency("k", 1) != state.latency("k", 2)
    local.update_config(SimConfig())


def test_stats_health_models_and_bad_requests(sim: SimulatorServer, local: Responder) -> None:
    before = httpx.get(f"{sim.base_url}/_sim/stats", timeout=30).json()
    chat(sim, "counted")
    chat(sim, "counted")
    after = httpx.get(f"{sim.base_url}/_sim/stats", timeout=30).json()
    key = local.key_for_messages([{"role": "user", "content": "counted"}])
    assert after["by_key"][key] == before["by_key"].get(key, 0) + 2
    assert after["total_requests"] == before["total_requests"] + 2
    assert after["by_status"]["200"] == before["by_status"].get("200", 0) + 2
    assert sim.stats()["by_key"][key] == after["by_key"][key]
    assert httpx.get(f"{sim.base_url}/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{sim.base_url}/v1/models", timeout=30).json()["data"][0]["id"] == BASELINE.model_name
    bad = httpx.post(f"{sim.base_url}/v1/chat/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400
    assert httpx.post(f"{sim.base_url}/generate", json={"sampling_params": {}}, timeout=30).status_code == 400


def test_serves_hundreds_of_concurrent_connections(sim: SimulatorServer) -> None:
    sim.update_config(latency_s=0.05)
    before = sim.stats(with_keys=False)["total_requests"]

    async def burst() -> list[int]:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(i: int) -> int:
                body = {"model": "m", "messages": [{"role": "user", "content": f"burst {i}"}]}
                async with session.post(f"{sim.base_url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            return await asyncio.gather(*(one(i) for i in range(400)))

    assert set(asyncio.run(burst())) == {200}
    assert sim.stats(with_keys=False)["total_requests"] == before + 400


def test_cli_builds_config_from_flags(tmp_path: Path) -> None:
    args, config = parse_args(
        ["--model-dir", str(tmp_path), "--port", "0", "--noncanonical-rate", "0.1", "--fail", "503:0.2:2:1.5"]
    )
    assert args.port == 0
    assert config.noncanonical_rate == 0.1
    assert config.failures == (FailureRule(status=503, rate=0.2, attempts=2, retry_after_s=1.5),)

"""The simulator as a provider that bills: its billing ledger, the key's account (GET /api/v1/key), cut requests
billed for what was generated, and a bill that survives the simulator being restarted on the same port."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from endpoint_sim.openrouter import cost_usd
from endpoint_sim.responder import Responder, SimConfig
from endpoint_sim.server import SimulatorServer


@pytest.fixture(scope="module")
def responder(tokenizer_dir: Path) -> Responder:
    """One tokenizer load for every simulator this module starts (each test sets its own config)."""
    return Responder(tokenizer_dir)


def simulator(tokenizer_dir: Path, responder: Responder, config: SimConfig, **kwargs: Any) -> SimulatorServer:
    responder.update_config(config)
    return SimulatorServer(tokenizer_dir, config, responder=responder, **kwargs)


def chat(base_url: str, content: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)


def key(base_url: str) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/api/v1/key", timeout=30)
    assert response.status_code == 200
    data: dict[str, Any] = response.json()["data"]
    return data


def test_the_key_record_has_openrouters_shape_and_reads_the_bill(tokenizer_dir: Path, responder: Responder) -> None:
    with simulator(tokenizer_dir, responder, SimConfig(key_limit_usd=0.001)) as sim:
        assert key(sim.base_url)["usage"] == 0.0
        answers = [chat(sim.base_url, f"bill me {i}") for i in range(3)]
        assert all(a.status_code == 200 for a in answers)
        assert answers[0].headers["X-Generation-Id"] == answers[0].json()["id"]
        data = key(sim.base_url)
        total = sum(a.json()["usage"]["cost"] for a in answers)
        assert data["usage"] == pytest.approx(total) == pytest.approx(sim.billing()["total_usd"])
        assert data["limit"] == 0.001 and data["limit_remaining"] == pytest.approx(max(0.0, 0.001 - total))
        assert {"label", "is_free_tier", "is_provisioning_key", "rate_limit"} <= set(data)
        while sim.billing()["total_usd"] < 0.001:
            assert chat(sim.base_url, f"more {time.monotonic()}").status_code == 200
        refused = chat(sim.base_url, "over the limit")
        assert refused.status_code == 402, "past the key's limit the provider refuses"
        sim.update_config(account_usage_lag_s=3600.0)
        assert key(sim.base_url)["usage"] == 0.0, "usage lags the bill by account_usage_lag_s"


def test_a_client_that_goes_away_mid_generation_is_billed_for_what_was_generated(
    tokenizer_dir: Path, responder: Responder
) -> None:
    """The stream's headers carry the generation id at once; the client reads them and the first chunk, then
    leaves halfway through the 1 s of generation: billed for the prompt and about half the completion."""
    config = SimConfig(latency_s=1.0, reasoning_words=(60, 60), content_words=(60, 60))

    async def leave_early(base_url: str) -> tuple[str, bytes]:
        body = {"model": "m", "messages": [{"role": "user", "content": "cut me"}], "stream": True}
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"{base_url}/v1/chat/completions", json=body)
            first = await resp.content.readline()
            await asyncio.sleep(0.5)
            resp.close()
            return resp.headers["X-Generation-Id"], first

    with simulator(tokenizer_dir, responder, config) as sim:
        gen_id, first = asyncio.run(leave_early(sim.base_url))
        assert first.startswith(b":")
        deadline = time.monotonic() + 10
        while not sim.billing()["records"]:
            assert time.monotonic() < deadline, "the cut request was never billed"
            time.sleep(0.05)
        (record,) = sim.billing()["records"]
        assert record["id"] == gen_id and record["cut"]
        lookup = httpx.get(f"{sim.base_url}/api/v1/generation", params={"id": gen_id}, timeout=30).json()["data"]
        assert lookup["total_cost"] == record["cost_usd"] and lookup["finish_reason"] == "cancelled"
        whole = chat(sim.base_url, "cut me", stream=False).json()["usage"]
        assert lookup["tokens_prompt"] == whole["prompt_tokens"]
        assert 0 < lookup["tokens_completion"] < whole["completion_tokens"]
        assert cost_usd(config, whole["prompt_tokens"], 0) < record["cost_usd"] < whole["cost"]


def test_the_bill_survives_a_restart_on_the_same_port_and_ids_never_repeat(
    tmp_path: Path, tokenizer_dir: Path, responder: Responder
) -> None:
    bill = tmp_path / "bill.jsonl"
    first = simulator(tokenizer_dir, responder, SimConfig(), billing_file=bill).start()
    port = first.port
    try:
        before = chat(first.base_url, "same prompt").json()
    finally:
        first.stop()
    again = simulator(tokenizer_dir, responder, SimConfig(), port=port, billing_file=bill).start()
    try:
        after = chat(again.base_url, "same prompt").json()
        assert before["id"] != after["id"], "a restarted simulator reused a generation id"
        assert before["id"].split("-", 2)[2] == after["id"].split("-", 2)[2], "same prompt key"
        ledger = again.billing()
        assert [r["id"] for r in ledger["records"]] == [before["id"], after["id"]]
        assert ledger["total_usd"] == pytest.approx(before["usage"]["cost"] + after["usage"]["cost"])
        old = httpx.get(f"{again.base_url}/api/v1/generation", params={"id": before["id"]}, timeout=30)
        assert old.status_code == 200 and old.json()["data"]["total_cost"] == before["usage"]["cost"]
        assert key(again.base_url)["usage"] == pytest.approx(ledger["total_usd"])
    finally:
        again.stop()


def test_a_streamed_answers_cost_reaches_the_client_only_once_it_is_billed(
    tokenizer_dir: Path, responder: Responder
) -> None:
    """With a delay between chunks the usage chunk, which quotes the cost, went out before the bill was written:
    a simulator killed between the two had handed clients 189 costs its own ledger never recorded, and a probe
    read the product's exact ledger as an over-count. The bill is written first."""
    with simulator(tokenizer_dir, responder, SimConfig(seed=3, stream_chunk_delay_s=0.02)) as sim:
        body = {"model": "m", "messages": [{"role": "user", "content": "billed before quoted"}], "stream": True}
        with httpx.stream("POST", f"{sim.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if '"usage"' in line:
                    assert sim.billing()["total_usd"] > 0, "the cost was quoted before it was billed"
                    break
            else:
                pytest.fail("no usage chunk")

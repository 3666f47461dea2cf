"""The simulator's streaming, failure kinds, rate limit, generation lookup and test hooks, over real sockets.

Each failure kind is checked for what it promises on its scheduled attempt and for a normal answer on the next,
because the generate client is tested against exactly these behaviours.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from endpoint_sim.__main__ import parse_args
from endpoint_sim.openrouter import COMMENT_EVERY, piece_counts
from endpoint_sim.responder import FailureRule, Responder, SimConfig, request_latency_s
from endpoint_sim.server import SimulatorServer

BASELINE = SimConfig()
API_KEY = "sk-or-v1-secret-key-1234567890"


def messages(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages(content), **extra}


def chat(sim: SimulatorServer, content: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{sim.base_url}/v1/chat/completions", json=chat_body(content, **extra), timeout=30)


@dataclass
class Outcome:
    """One request as an aiohttp client saw it: the response, or the exception it raised."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""
    error: BaseException | None = None

    @property
    def text(self) -> str:
        return self.raw.decode()


async def _post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None, timeout: aiohttp.ClientTimeout
) -> Outcome:
    out = Outcome()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.post(url, json=body, headers=headers) as resp:
                out.status, out.headers = resp.status, dict(resp.headers)
                async for chunk in resp.content.iter_any():
                    out.raw += chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            out.error = exc
    return out


def post(
    sim: SimulatorServer,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
) -> Outcome:
    return asyncio.run(_post(f"{sim.base_url}{path}", body, headers, timeout or aiohttp.ClientTimeout(total=30)))


@dataclass
class Sse:
    comments: list[str]
    data: list[Any]
    done: bool
    tail: str

    @property
    def deltas(self) -> list[dict[str, Any]]:
        return [d["choices"][0]["delta"] for d in self.data if d.get("choices") and d["choices"][0]["delta"]]

    def joined(self, field_name: str) -> str:
        return "".join(d.get(field_name, "") for d in self.deltas)


def parse_sse(text: str) -> Sse:
    """Events are separated by a blank line; an unterminated last block is kept raw in `tail`."""
    *blocks, tail = text.split("\n\n")
    sse = Sse([], [], False, tail)
    for block in blocks:
        if block.startswith(":"):
            sse.comments.append(block)
        elif block == "data: [DONE]":
            sse.done = True
        else:
            assert block.startswith("data: ") and not sse.done
            sse.data.append(json.loads(block[len("data: ") :]))
    return sse


def with_rule(sim: SimulatorServer, kind: str, **fields: Any) -> None:
    sim.update_config(failures=(FailureRule(kind=kind, rate=1.0, attempts=1, **fields),))


def test_stream_reassembles_exactly_the_non_streaming_answer(sim: SimulatorServer) -> None:
    for i, limit in enumerate((None, None, 40, 5)):
        prompt = f"stream me {i}"
        extra = {"max_tokens": limit} if limit else {}
        whole = chat(sim, prompt, **extra).json()
        out = post(sim, "/v1/chat/completions", chat_body(prompt, stream=True, **extra))
        assert out.status == 200 and out.headers["Content-Type"].startswith("text/event-stream")
        sse = parse_sse(out.text)
        assert sse.tail == "" and sse.done
        assert sse.comments[0] == ": OPENROUTER PROCESSING"
        message = whole["choices"][0]["message"]
        assert sse.joined("reasoning") == message["reasoning"]
        assert sse.joined("content") == message["content"]
        kinds = ["reasoning" if "reasoning" in d else "content" for d in sse.deltas]
        assert kinds == sorted(kinds, reverse=True), "reasoning pieces come before content pieces"
        n_reasoning, n_content = piece_counts(whole["id"].rsplit("-", 1)[1])
        assert kinds.count("reasoning") == min(n_reasoning, len(message["reasoning"]))
        assert kinds.count("content") == min(n_content, len(message["content"]))
        assert len(sse.comments) == 1 + (len(sse.deltas) - 1) // COMMENT_EVERY
        *chunks, finish, last = sse.data
        assert all(c["object"] == "chat.completion.chunk" and c["choices"][0]["finish_reason"] is None for c in chunks)
        assert {c["id"] for c in sse.data} == {sse.data[0]["id"]} and sse.data[0]["id"] != whole["id"]
        assert finish["choices"] == [
            {
                "index": 0,
                "delta": {},
                "finish_reason": whole["choices"][0]["finish_reason"],
                "native_finish_reason": whole["choices"][0]["finish_reason"],
            }
        ]
        assert last["choices"] == [] and last["usage"] == whole["usage"]
    no_usage = post(
        sim, "/v1/chat/completions", chat_body("stream me 0", stream=True, stream_options={"include_usage": False})
    )
    sse = parse_sse(no_usage.text)
    assert sse.done and all("usage" not in d for d in sse.data)


def test_response_replacing_failures_then_a_normal_answer(sim: SimulatorServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with_rule(sim, "invalid_json")
    bad = post(sim, "/v1/chat/completions", chat_body("invalid json"))
    assert (bad.status, bad.headers["Content-Type"].split(";")[0]) == (200, "text/html")
    assert bad.text == "<html><body>502 Bad Gateway</body></html>"
    with_rule(sim, "echo_key")
    echoed = post(sim, "/v1/chat/completions", chat_body("echo key"), headers=headers)
    assert echoed.status == 400 and f"Bearer {API_KEY}" in json.loads(echoed.raw)["error"]["message"]
    with_rule(sim, "reset")
    reset = post(sim, "/v1/chat/completions", chat_body("reset"))
    assert isinstance(reset.error, aiohttp.ClientOSError | aiohttp.ServerDisconnectedError) and reset.status == 0
    with_rule(sim, "disconnect")
    gone = post(sim, "/v1/chat/completions", chat_body("disconnect", stream=True))
    assert isinstance(gone.error, aiohttp.ServerDisconnectedError)
    with_rule(sim, "http", status=402)
    assert post(sim, "/v1/chat/completions", chat_body("payment", stream=True)).status == 402
    for prompt in ("invalid json", "echo key", "reset", "payment"):
        assert chat(sim, prompt).json()["choices"][0]["finish_reason"] == "stop"
    assert post(sim, "/v1/chat/completions", chat_body("disconnect", stream=True)).status == 200
    injected = sim.stats(with_keys=False)["injected"]
    assert {"invalid_json", "echo_key", "reset", "disconnect", "http_402"} <= set(injected)


def test_finish_error_bills_half_the_content(sim: SimulatorServer, local: Responder) -> None:
    for kind in ("finish_error", "midstream_error"):
        with_rule(sim, kind)
        prompt = f"{kind} plain"
        broken = chat(sim, prompt).json()
        whole = chat(sim, prompt).json()
        full, part = whole["choices"][0]["message"], broken["choices"][0]["message"]
        assert broken["choices"][0]["finish_reason"] == "error" and whole["choices"][0]["finish_reason"] == "stop"
        assert part["reasoning"] == full["reasoning"]
        assert part["content"] == full["content"][: len(full["content"]) // 2]
        reasoning_tokens = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
        expected_tokens = reasoning_tokens + 1 + len(local.prompt_ids_for_text(part["content"]))
        assert broken["usage"]["completion_tokens"] == expected_tokens < whole["usage"]["completion_tokens"]
    with_rule(sim, "finish_error")
    sse = parse_sse(post(sim, "/v1/chat/completions", chat_body("finish_error stream", stream=True)).text)
    whole = chat(sim, "finish_error stream").json()["choices"][0]["message"]
    assert sse.done and sse.joined("content") == whole["content"][: len(whole["content"]) // 2]
    assert sse.data[-2]["choices"][0]["finish_reason"] == "error" and sse.data[-1]["usage"]["completion_tokens"] > 0


def test_midstream_and_truncated_streams_end_without_done(sim: SimulatorServer) -> None:
    with_rule(sim, "midstream_error")
    out = post(sim, "/v1/chat/completions", chat_body("midstream", stream=True))
    sse = parse_sse(out.text)
    assert out.error is None and not sse.done and sse.tail == "" and sse.deltas
    last = sse.data[-1]
    assert last["error"] == {"code": 502, "message": "Provider disconnected"}
    assert last["choices"] == [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}]
    assert all(d.get("usage") is None for d in sse.data)
    with_rule(sim, "truncated_json")
    cut = parse_sse(post(sim, "/v1/chat/completions", chat_body("truncated stream", stream=True)).text)
    assert not cut.done and cut.deltas and cut.tail.startswith("data: {")
    assert all(c["choices"][0]["finish_reason"] is None for c in cut.data)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.tail[len("data: ") :])
    body = post(sim, "/v1/chat/completions", chat_body("truncated plain"))
    assert body.status == 200 and body.headers["Content-Type"].startswith("application/json")
    assert body.text.startswith('{"id": "gen-1-')
    with pytest.raises(json.JSONDecodeError):
        json.loads(body.raw)
    for prompt in ("midstream", "truncated stream"):
        assert parse_sse(post(sim, "/v1/chat/completions", chat_body(prompt, stream=True)).text).done
    assert "choices" in chat(sim, "truncated plain").json()


def test_midstream_reset_cuts_the_body_with_a_tcp_reset(sim: SimulatorServer) -> None:
    with_rule(sim, "midstream_reset")
    stream = post(sim, "/v1/chat/completions", chat_body("reset midway stream", stream=True))
    assert stream.status == 200 and isinstance(stream.error, aiohttp.ClientPayloadError | aiohttp.ClientOSError)
    assert not parse_sse(stream.text).done
    plain = post(sim, "/v1/chat/completions", chat_body("reset midway plain"))
    assert plain.status == 200 and isinstance(plain.error, aiohttp.ClientPayloadError | aiohttp.ClientOSError)
    assert parse_sse(post(sim, "/v1/chat/completions", chat_body("reset midway stream", stream=True)).text).done
    assert chat(sim, "reset midway plain").status_code == 200


def test_empty_answers(sim: SimulatorServer) -> None:
    with_rule(sim, "empty")
    empty = chat(sim, "empty").json()
    assert empty["choices"][0]["message"] == {"role": "assistant", "content": "", "reasoning": ""}
    assert empty["usage"]["completion_tokens"] == 0
    sse = parse_sse(post(sim, "/v1/chat/completions", chat_body("empty stream", stream=True)).text)
    assert sse.done and sse.deltas == [] and sse.data[-1]["usage"]["completion_tokens"] == 0
    with_rule(sim, "empty_reasoning")
    hidden = chat(sim, "no reasoning").json()
    full = chat(sim, "no reasoning").json()
    assert hidden["choices"][0]["message"]["reasoning"] == ""
    assert hidden["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"]
    assert chat(sim, "empty").json()["usage"]["completion_tokens"] > 0


def test_hang_trips_client_timeouts_and_frees_the_server(sim: SimulatorServer) -> None:
    with_rule(sim, "hang", hang_s=30.0)
    plain = post(sim, "/v1/chat/completions", chat_body("hang plain"), timeout=aiohttp.ClientTimeout(total=0.3))
    assert isinstance(plain.error, asyncio.TimeoutError) and plain.status == 0
    idle = aiohttp.ClientTimeout(total=30, sock_read=0.3)
    stalled = post(sim, "/v1/chat/completions", chat_body("hang stream", stream=True), timeout=idle)
    assert stalled.status == 200 and isinstance(stalled.error, asyncio.TimeoutError)
    sse = parse_sse(stalled.text)
    assert sse.comments == [": OPENROUTER PROCESSING"] and len(sse.data) == 1 and not sse.done
    for _ in range(100):
        if sim.stats(with_keys=False)["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert sim.stats(with_keys=False)["in_flight"] == 0, "a client that gave up must not hold a server slot"
    assert chat(sim, "hang plain").status_code == 200
    assert parse_sse(post(sim, "/v1/chat/completions", chat_body("hang stream", stream=True)).text).done


def test_generate_route_failure_kinds(sim: SimulatorServer, local: Responder) -> None:
    ids = list(local.prompt_ids_for_messages(messages("generate kinds")))
    body = {"input_ids": ids, "sampling_params": {"skip_special_tokens": False}}
    with_rule(sim, "finish_error")
    aborted = post(sim, "/generate", body)
    whole = post(sim, "/generate", body)
    part, full = json.loads(aborted.raw), json.loads(whole.raw)
    assert part["meta_info"]["finish_reason"]["type"] == "abort"
    assert part["output_ids"] == full["output_ids"][: len(full["output_ids"]) // 2]
    assert part["meta_info"]["completion_tokens"] == len(part["output_ids"])
    with_rule(sim, "empty")
    body["input_ids"] = [*ids, 1]
    empty = json.loads(post(sim, "/generate", body).raw)
    assert (empty["text"], empty["output_ids"], empty["meta_info"]["completion_tokens"]) == ("", [], 0)
    kinds = ("truncated_json", "invalid_json", "reset", "midstream_reset", "hang", "context_length")
    for i, kind in enumerate(kinds):
        with_rule(sim, kind, hang_s=30.0)
        body["input_ids"] = [*ids, 2, i]
        out = post(sim, "/generate", body, timeout=aiohttp.ClientTimeout(total=0.5))
        if kind == "truncated_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(out.raw)
        elif kind == "invalid_json":
            assert out.headers["Content-Type"].startswith("text/html")
        elif kind == "context_length":
            assert out.status == 400
        else:
            assert out.error is not None
        assert json.loads(post(sim, "/generate", body).raw)["meta_info"]["finish_reason"]["type"] == "stop"


def test_concurrency_over_the_limit_gets_429(sim: SimulatorServer) -> None:
    sim.update_config(rate_limit_concurrency=4, rate_limit_retry_after_s=0.5, latency_s=1.0)
    sim.reset_stats()

    async def burst() -> list[tuple[int, str | None]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

            async def one(i: int) -> tuple[int, str | None]:
                async with session.post(f"{sim.base_url}/v1/chat/completions", json=chat_body(f"limit {i}")) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After")

            return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(burst())
    stats = sim.stats()
    refused = [r for r in results if r[0] == 429]
    assert refused and all(retry == "0.5" for _, retry in refused)
    assert {status for status, _ in results} == {200, 429}
    assert stats["peak_in_flight"] == 4 and stats["in_flight"] == 0
    assert stats["rate_limited"] == len(refused) == stats["by_status"]["429"]
    assert sum(stats["by_key"].values()) == 16 - len(refused), "refused requests are not attempts"


def test_generation_lookup(sim: SimulatorServer, local: Responder) -> None:
    sim.update_config(generation_cost_factor=1.5, latency_lognormal=(-5.0, 0.5))
    answer = chat(sim, "bill me").json()
    streamed = parse_sse(post(sim, "/v1/chat/completions", chat_body("bill me", stream=True)).text)
    before = sim.stats()
    for route, gen_id in (("/api/v1/generation", answer["id"]), ("/v1/generation", streamed.data[0]["id"])):
        found = httpx.get(f"{sim.base_url}{route}", params={"id": gen_id}, timeout=30)
        data = found.json()["data"]
        assert found.status_code == 200 and data["id"] == gen_id
        assert data["total_cost"] == pytest.approx(answer["usage"]["cost"] * 1.5)
        assert data["tokens_prompt"] == data["native_tokens_prompt"] == answer["usage"]["prompt_tokens"]
        assert data["tokens_completion"] == data["native_tokens_completion"] == answer["usage"]["completion_tokens"]
        reasoning = answer["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert data["native_tokens_reasoning"] == reasoning
        assert (data["finish_reason"], data["provider_name"], data["model"]) == (
            "stop",
            answer["provider"],
            BASELINE.model_name,
        )
        assert data["streamed"] == (route == "/v1/generation")
        attempt = int(gen_id.split("-")[1])
        key = local.key_for_messages(messages("bill me"))
        assert data["latency"] == round(request_latency_s(sim.config, key, attempt) * 1000) > 0
        assert data["generation_time"] >= data["latency"] - 1
        # Billing drift: the answer's usage.cost understates the bill, and the provider's own books agree on it.
        bill = next(r for r in sim.billing()["records"] if r["id"] == gen_id)
        assert bill["cost_usd"] == pytest.approx(data["total_cost"], abs=1e-15)
    key_usage = httpx.get(f"{sim.base_url}/api/v1/key", timeout=30).json()["data"]["usage"]
    assert key_usage == pytest.approx(sim.billing()["total_usd"], abs=1e-15)
    missing = httpx.get(f"{sim.base_url}/api/v1/generation", params={"id": "gen-nope"}, timeout=30)
    assert missing.status_code == 404 and missing.json() == {"error": {"code": 404, "message": "Generation not found"}}
    after = sim.stats()
    assert after["by_key"] == before["by_key"] and after["total_requests"] == before["total_requests"]
    assert after["by_route"]["generation_lookup"] == before["by_route"].get("generation_lookup", 0) + 3
    sim.update_config(generation_lookup_delay_s=3600.0)
    fresh = chat(sim, "bill me later").json()["id"]
    assert httpx.get(f"{sim.base_url}/api/v1/generation", params={"id": fresh}, timeout=30).status_code == 404
    sim.update_config(generation_lookup_delay_s=0.0, required_api_key=API_KEY)
    assert httpx.get(f"{sim.base_url}/api/v1/generation", params={"id": fresh}, timeout=30).status_code == 401
    authed = httpx.get(
        f"{sim.base_url}/api/v1/generation",
        params={"id": fresh},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert authed.status_code == 200


def test_http_config_and_reset_hooks(sim: SimulatorServer) -> None:
    rule = {"kind": "empty", "rate": 1.0, "attempts": 1}
    new = httpx.post(f"{sim.base_url}/_sim/config", json={"failures": [rule], "latency_s": 0.01}, timeout=30)
    assert new.status_code == 200 and new.json()["failures"][0]["kind"] == "empty"
    assert sim.config.failures == (FailureRule(kind="empty", rate=1.0),) and sim.config.latency_s == 0.01
    assert chat(sim, "hooks").json()["usage"]["completion_tokens"] == 0
    assert chat(sim, "hooks").json()["usage"]["completion_tokens"] > 0
    assert httpx.post(f"{sim.base_url}/_sim/config", json={"no_such_knob": 1}, timeout=30).status_code == 400
    assert httpx.post(f"{sim.base_url}/_sim/config", json={"latency_s": -1}, timeout=30).status_code == 400
    assert sim.config.latency_s == 0.01
    reset = httpx.post(f"{sim.base_url}/_sim/reset", timeout=30).json()
    assert reset["total_requests"] == 0 and sim.stats()["by_key"] == {}
    assert chat(sim, "hooks").json()["usage"]["completion_tokens"] == 0, "attempt numbers start over"


def test_stop_is_not_blocked_by_a_hanging_stream(tokenizer_dir: Path) -> None:
    srv = SimulatorServer(tokenizer_dir, SimConfig(failures=(FailureRule(kind="hang", rate=1.0, hang_s=60.0),))).start()

    async def hold_then_stop() -> bool:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(f"{srv.base_url}/v1/chat/completions", json=chat_body("hold", stream=True))
            await resp.content.readuntil(b"}\n\n")
            await asyncio.wait_for(asyncio.to_thread(srv.stop), timeout=15)
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
            return True

    assert asyncio.run(hold_then_stop())


def test_cli_accepts_new_fields_and_failure_kinds(tmp_path: Path) -> None:
    config_json = tmp_path / "sim.json"
    config_json.write_text(json.dumps({"rate_limit_concurrency": 8, "generation_lookup_delay_s": 0.5}))
    args, config = parse_args(
        [
            "--model-dir",
            str(tmp_path),
            "--port",
            "0",
            "--port-file",
            str(tmp_path / "port"),
            "--config-json",
            str(config_json),
            "--fail",
            "reset:0.1",
            "--fail",
            "hang:0.1:2:5",
            "--fail",
            "429:0.1:1:0.5",
        ]
    )
    assert args.port_file == tmp_path / "port"
    assert (config.rate_limit_concurrency, config.generation_lookup_delay_s) == (8, 0.5)
    assert config.failures == (
        FailureRule(kind="reset", rate=0.1),
        FailureRule(kind="hang", rate=0.1, attempts=2, hang_s=5.0),
        FailureRule(status=429, rate=0.1, retry_after_s=0.5),
    )
    with pytest.raises(SystemExit):
        parse_args(["--model-dir", str(tmp_path), "--fail", "nonsense:0.1"])


@pytest.mark.slow  # moved to make test-long (CI runs both) to keep make test near 6 minutes
def test_module_serves_on_a_free_port_from_a_port_file(tokenizer_dir: Path, tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "endpoint_sim",
            "--model-dir",
            str(tokenizer_dir),
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        for _ in range(600):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        port = int(port_file.read_text())
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
        assert httpx.post(f"{base}/_sim/config", json={"seed": 7}, timeout=30).json()["seed"] == 7
        assert httpx.get(f"{base}/_sim/stats", timeout=30).json()["in_flight"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert stdout.splitlines() == [f"endpoint-sim serving {tokenizer_dir} on http://127.0.0.1:{port}"]

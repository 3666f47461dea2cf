"""The generate stage against a real simulator on 127.0.0.1: rows, retries, fatal errors, resume, crash chunks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import SecretStr, ValidationError
from transformers import PreTrainedTokenizerBase

from endpoint_sim.responder import REASONING_CLOSE, FailureRule, Responder, SimConfig, SimSample
from endpoint_sim.server import SimState, SimulatorServer
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, SamplingConfig, TokenizerConfig
from tasks.common.errors import FatalEndpointError
from tasks.common.messages import prompt_messages, sample_id
from tasks.common.schemas import PROMPTS, RESPONSES
from tasks.common.shards import PartRef, read_marker, read_part, stage_metadata, write_parquet_atomic, write_part
from tasks.generate import CompletionMarkers, generate_parts
from tasks.generate.chunks import chunk_dir
from tasks.generate.client import backoff_delay, parse_retry_after
from tasks.generate.endpoints import build_request, endpoint_url, split_completion
from tasks.generate.engine import nothing_to_send_summary
from tasks.reconstruct.tokenizer_loading import render_prompt_ids

EOS = "<｜end▁of▁sentence｜>"
MARKERS = CompletionMarkers(reasoning_close=REASONING_CLOSE, end_of_turn=EOS)
BASELINE = SimConfig()


def make_cfg(run_dir: Path, sim: SimulatorServer, model_dir: Path, **endpoint: Any) -> PipelineConfig:
    sampling = endpoint.pop("sampling", SamplingConfig())
    settings: dict[str, Any] = {
        "base_url": sim.base_url,
        "model": "sim/deepseek-v4-sim",
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "max_in_flight": 4,
        "commit_every_samples": 3,
        **endpoint,
    }
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="ds", path=model_dir)],
        endpoint=EndpointConfig(**settings),
        sampling=sampling,
        tokenizer=TokenizerConfig(path=model_dir),
    )


def write_prompts(run_dir: Path, part: int, n: int, tag: str) -> list[dict[str, Any]]:
    """A prompts part; every third conversation carries a stale assistant answer that must not be sent."""
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"[{tag}] part {part} question {i}: what lies NORTH of Paris?"}]
        if i % 3 == 0:
            messages = [{"role": "system", "content": "Answer briefly."}, *messages]
        if i % 3 == 1:
            messages.append({"role": "assistant", "content": "some other model's answer"})
        rows.append(
            {
                "sample_id": sample_id("ds", messages),  # type: ignore[arg-type]
                "dataset": "ds",
                "source_file": "prompts.jsonl",
                "source_row": i,
                "messages": messages,
                "prompt_id": sample_id("ds", messages),  # type: ignore[arg-type]
                "sample_index": 0,
            }
        )
    write_part(PartRef(run_dir, "prompts", part), pa.Table.from_pylist(rows, schema=PROMPTS), provenance={})
    return rows


def refs(run_dir: Path, parts: int) -> list[PartRef]:
    return [PartRef(run_dir, "prompts", i) for i in range(parts)]


def responses(run_dir: Path, part: int) -> dict[str, dict[str, Any]]:
    table = read_part(PartRef(run_dir, "responses", part))
    rows = table.to_pylist()
    assert len({r["sample_id"] for r in rows}) == len(rows), "a sample appears twice"
    return {r["sample_id"]: r for r in rows}


def expect(local: Responder, sim: SimulatorServer, prompt_row: dict[str, Any]) -> SimSample:
    local.update_config(sim.config)
    return local.sample_for_messages([dict(m) for m in prompt_messages(prompt_row["messages"])])


def key_of(local: Responder, prompt_row: dict[str, Any]) -> str:
    return local.key_for_messages([dict(m) for m in prompt_messages(prompt_row["messages"])])


def test_openai_chat_rows_across_parts(
    tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = {p: write_prompts(tmp_path, p, 7, "chat") for p in range(3)}
    cfg = make_cfg(tmp_path, sim, tokenizer_dir, max_in_flight=3, commit_every_samples=2)
    summary = generate_parts(cfg, refs(tmp_path, 3), MARKERS)
    total = summary.to_dict()["total"]
    assert (total["done"], total["failed"], total["requests_sent"], total["samples"]) == (21, 0, 21, 21)
    for part, rows in prompts.items():
        got = responses(tmp_path, part)
        assert list(got) == [r["sample_id"] for r in rows]
        for row in rows:
            out = got[row["sample_id"]]
            sample = expect(local, sim, row)
            prompt_ids = render_prompt_ids(tokenizer, prompt_messages(row["messages"]))
            assert out["status"] == "done" and out["error"] is None and out["attempts"] == 1
            assert (out["reasoning"], out["content"]) == (sample.reasoning, sample.content)
            assert out["finish_reason"] == "stop"
            assert out["prompt_tokens"] == len(prompt_ids)
            assert out["completion_tokens"] == len(sample.output_ids)
            assert out["reasoning_tokens"] == sample.reasoning_tokens
            prices = (sim.config.price_prompt_usd_per_mtok, sim.config.price_completion_usd_per_mtok)
            billed = (len(prompt_ids) * prices[0] + len(sample.output_ids) * prices[1]) / 1e6
            assert out["cost_usd"] == pytest.approx(billed)
            assert out["provider"] == sample.provider
            assert out["model"] == BASELINE.model_name
            assert out["generation_id"] == f"gen-1-{sample.key}"
            assert out["output_ids"] is None and out["latency_s"] is not None
        assert not chunk_dir(tmp_path, part).exists()
        assert read_marker(PartRef(tmp_path, "responses", part))["stats"]["done"] == 7


def test_sglang_generate_rows_keep_exact_output_ids(
    tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    sim.update_config(noncanonical_rate=0.5)
    rows = write_prompts(tmp_path, 0, 8, "sglang")
    cfg = make_cfg(
        tmp_path,
        sim,
        tokenizer_dir,
        kind="sglang_generate",
        price_prompt_usd_per_mtok=1.0,
        price_completion_usd_per_mtok=3.0,
    )
    summary = generate_parts(cfg, refs(tmp_path, 1), MARKERS, tokenizer)
    assert summary.parts[0].done == 8
    got = responses(tmp_path, 0)
    noncanonical = 0
    for row in rows:
        out = got[row["sample_id"]]
        sample = expect(local, sim, row)
        noncanonical += sample.noncanonical
        assert out["status"] == "done"
        assert (out["reasoning"], out["content"]) == (sample.reasoning, sample.content)
        assert out["output_ids"] == list(sample.output_ids)
        assert tokenizer.decode(out["output_ids"]) == out["reasoning"] + REASONING_CLOSE + out["content"] + EOS
        assert out["prompt_ids"] == render_prompt_ids(tokenizer, prompt_messages(row["messages"]))
        assert out["prompt_tokens"] == len(out["prompt_ids"])
        assert out["completion_tokens"] == len(out["output_ids"])
        assert out["reasoning_tokens"] == out["output_ids"].index(tokenizer.convert_tokens_to_ids(REASONING_CLOSE))
        assert out["cost_usd"] == pytest.approx((out["prompt_tokens"] * 1.0 + out["completion_tokens"] * 3.0) / 1e6)
        assert out["generation_id"] == f"1-{sample.key}" and out["finish_reason"] == "stop"
    assert noncanonical > 0


def test_chat_cost_falls_back_to_the_price_table(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path) -> None:
    sim.update_config(report_cost=False)
    write_prompts(tmp_path, 0, 3, "price")
    cfg = make_cfg(tmp_path, sim, tokenizer_dir, price_prompt_usd_per_mtok=10.0, price_completion_usd_per_mtok=20.0)
    generate_parts(cfg, refs(tmp_path, 1), MARKERS)
    for out in responses(tmp_path, 0).values():
        assert out["cost_usd"] == pytest.approx((out["prompt_tokens"] * 10 + out["completion_tokens"] * 20) / 1e6)


def test_transient_failures_are_retried_until_done(
    tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path
) -> None:
    config = sim.update_config(
        failures=(
            FailureRule(status=500, rate=0.2, attempts=2),
            FailureRule(status=503, rate=0.2, attempts=1),
            FailureRule(status=429, rate=0.2, attempts=1, retry_after_s=0.01),
            FailureRule(kind="error_body", rate=0.2, attempts=1),
        )
    )
    local.update_config(config)
    state = SimState(local)
    rows = write_prompts(tmp_path, 0, 15, "retry")
    summary = generate_parts(make_cfg(tmp_path, sim, tokenizer_dir), refs(tmp_path, 1), MARKERS)
    got = responses(tmp_path, 0)
    retried = 0
    for row in rows:
        rule = state.failure_rule(key_of(local, row), 1)
        want = 1 + (rule.attempts or 0 if rule else 0)
        assert got[row["sample_id"]]["status"] == "done"
        assert got[row["sample_id"]]["attempts"] == want
        retried += want > 1
    assert retried > 0
    assert summary.parts[0].requests_sent == sum(r["attempts"] for r in got.values())
    assert set(summary.parts[0].retries_by_reason) == {"http_500", "http_503", "http_429", "error_body"}
    assert sum(summary.parts[0].retries_by_reason.values()) == summary.parts[0].requests_sent - 15


def test_400_fails_the_sample_without_retry_and_rerun_retries_it_only_when_asked(
    tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path
) -> None:
    """context_length is deterministic: a plain rerun keeps the failure (no re-buy), `retry_failed=all` resends."""
    sim.update_config(failures=(FailureRule(kind="context_length", status=400, rate=0.4, attempts=None),))
    rows = {p: write_prompts(tmp_path, p, 6, "rerun") for p in range(2)}
    cfg = make_cfg(tmp_path, sim, tokenizer_dir)
    first = generate_parts(cfg, refs(tmp_path, 2), MARKERS).to_dict()["total"]
    assert first["failed"] > 0 and first["done"] > 0
    assert first["failures_by_reason"] == {"context_length": first["failed"]}
    stats = sim.stats()["by_key"]
    failed_keys: set[str] = set()
    for part in rows:
        for row in rows[part]:
            out = responses(tmp_path, part)[row["sample_id"]]
            assert stats[key_of(local, row)] == 1
            if out["status"] == "failed":
                assert out["attempts"] == 1 and "HTTP 400" in out["error"]
                failed_keys.add(key_of(local, row))

    sim.update_config(failures=())
    kept = generate_parts(cfg, refs(tmp_path, 2), MARKERS).to_dict()["total"]
    assert (kept["requests_sent"], kept["kept_failed"]) == (0, len(failed_keys))
    # The pipeline, seeing nothing to send, reports the same without calling generate (it said 0 samples, $0).
    idle = nothing_to_send_summary(tmp_path, [0, 1]).total()
    for key in (
        "samples",
        "skipped_already_done",
        "kept_failed",
        "kept_failed_by_reason",
        "run_dir_billed_usd",
        "run_dir_counted_usd",
    ):
        assert idle[key] == kept[key], key
    # The run summary's rows add up to the samples: the kept failures are a row with their reasons (a UI probe)
    assert kept["kept_failed_by_reason"] == {"context_length": len(failed_keys)}
    assert kept["done"] + kept["failed"] + kept["skipped_already_done"] + kept["kept_failed"] == kept["samples"]
    assert idle["samples"] == 12 and idle["run_dir_billed_usd"] > 0
    assert sim.stats()["by_key"] == stats, "a deterministic failure was re-sent by a plain rerun"

    cfg = make_cfg(tmp_path, sim, tokenizer_dir, retry_failed="all")
    second = generate_parts(cfg, refs(tmp_path, 2), MARKERS).to_dict()["total"]
    assert second["requests_sent"] == len(failed_keys)
    assert (second["done"], second["failed"], second["skipped_already_done"]) == (len(failed_keys), 0, first["done"])
    after = sim.stats()["by_key"]
    for part in rows:
        for row in rows[part]:
            key = key_of(local, row)
            assert after[key] == stats[key] + (key in failed_keys)
            assert responses(tmp_path, part)[row["sample_id"]]["status"] == "done"

    total_before = sim.stats(with_keys=False)["total_requests"]
    third = generate_parts(cfg, refs(tmp_path, 2), MARKERS).to_dict()["total"]
    assert third["requests_sent"] == 0 and third["skipped_already_done"] == 12
    assert sim.stats(with_keys=False)["total_requests"] == total_before


def test_401_is_fatal_and_never_leaks_the_key(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim.update_config(required_api_key="sk-the-right-one")
    write_prompts(tmp_path, 0, 4, "auth")
    secret = "sk-or-v1-THIS-MUST-NOT-LEAK"
    cfg = make_cfg(tmp_path, sim, tokenizer_dir, api_key=SecretStr(secret))
    with pytest.raises(FatalEndpointError) as info:
        generate_parts(cfg, refs(tmp_path, 1), MARKERS)
    assert "401" in str(info.value) and secret not in str(info.value)
    assert not PartRef(tmp_path, "responses", 0).is_done()

    monkeypatch.setenv("SIM_TEST_KEY", "sk-the-right-one")
    good = make_cfg(tmp_path, sim, tokenizer_dir, api_key_env="SIM_TEST_KEY")
    assert generate_parts(good, refs(tmp_path, 1), MARKERS).parts[0].done == 4


def test_length_truncation_fails_unless_kept(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path) -> None:
    write_prompts(tmp_path, 0, 3, "length")
    short = SamplingConfig(max_tokens=6)
    cfg = make_cfg(tmp_path, sim, tokenizer_dir, sampling=short)
    assert generate_parts(cfg, refs(tmp_path, 1), MARKERS).parts[0].failures_by_reason == {"length": 3}
    for out in responses(tmp_path, 0).values():
        assert out["status"] == "failed" and "max_tokens=6" in out["error"]
        assert out["finish_reason"] == "length" and out["completion_tokens"] == 6
    keep = make_cfg(tmp_path, sim, tokenizer_dir, sampling=short, keep_length_truncated=True)
    assert generate_parts(keep, refs(tmp_path, 1), MARKERS).parts[0].done == 3
    assert {r["status"] for r in responses(tmp_path, 0).values()} == {"done"}


def test_leftover_chunks_are_honoured(
    tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path
) -> None:
    rows = write_prompts(tmp_path, 0, 6, "chunks")
    out_ref = PartRef(tmp_path, "responses", 0)
    crashed = []
    for i, row in enumerate(rows[:4]):
        rec: dict[str, Any] = {name: None for name in RESPONSES.names}
        rec.update(sample_id=row["sample_id"], dataset="ds", attempts=1)
        if i < 3:
            rec.update(status="done", reasoning="r", content="c", generation_id="from-chunk")
        else:
            rec.update(status="failed", error="HTTP 503: earlier run")
        crashed.append(rec)
    table = pa.Table.from_pylist(crashed, schema=RESPONSES)
    write_parquet_atomic(
        chunk_dir(out_ref.run_dir, out_ref.part) / "chunk-000000.parquet", table, stage_metadata("responses", {})
    )
    before = sim.stats()["by_key"]
    summary = generate_parts(make_cfg(tmp_path, sim, tokenizer_dir), refs(tmp_path, 1), MARKERS)
    assert (summary.parts[0].skipped_already_done, summary.parts[0].requests_sent) == (3, 3)
    after = sim.stats()["by_key"]
    got = responses(tmp_path, 0)
    assert list(got) == [r["sample_id"] for r in rows]
    for i, row in enumerate(rows):
        key = key_of(local, row)
        if i < 3:
            assert after.get(key, 0) == before.get(key, 0)
            assert got[row["sample_id"]]["generation_id"] == "from-chunk"
        else:
            assert after[key] == before.get(key, 0) + 1
            assert got[row["sample_id"]]["status"] == "done"
    assert not chunk_dir(out_ref.run_dir, out_ref.part).exists()


def test_fatal_mid_run_commits_finished_samples_and_resume_sends_only_the_rest(
    tmp_path: Path, sim: SimulatorServer, local: Responder, tokenizer_dir: Path
) -> None:
    sim.update_config(failures=(FailureRule(status=401, rate=0.35, attempts=None),))
    rows = {p: write_prompts(tmp_path, p, 8, "crash") for p in range(2)}
    cfg = make_cfg(tmp_path, sim, tokenizer_dir, max_in_flight=2, commit_every_samples=1)
    with pytest.raises(FatalEndpointError):
        generate_parts(cfg, refs(tmp_path, 2), MARKERS)
    committed: dict[str, dict[str, Any]] = {}
    for part in rows:
        out_ref = PartRef(tmp_path, "responses", part)
        if out_ref.is_done():
            committed.update(responses(tmp_path, part))
        for path in sorted(chunk_dir(out_ref.run_dir, out_ref.part).glob("chunk-*.parquet")):
            committed.update({r["sample_id"]: r for r in pq.read_table(path).to_pylist()})
    done_before = {sid for sid, r in committed.items() if r["status"] == "done"}
    assert done_before, "some samples finish before the first 401"
    stats = sim.stats()["by_key"]

    sim.update_config(failures=())
    summary = generate_parts(cfg, refs(tmp_path, 2), MARKERS).to_dict()["total"]
    assert summary["skipped_already_done"] == len(done_before)
    after = sim.stats()["by_key"]
    for part in rows:
        got = responses(tmp_path, part)
        assert list(got) == [r["sample_id"] for r in rows[part]]
        for row in rows[part]:
            key = key_of(local, row)
            assert got[row["sample_id"]]["status"] == "done"
            if row["sample_id"] in done_before:
                assert after[key] == stats[key]
            else:
                assert after[key] == stats.get(key, 0) + 1


def test_request_building_for_both_kinds(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    sampling = SamplingConfig(temperature=0.3, top_p=0.9, max_tokens=77, seed=5)
    cfg = make_cfg(
        tmp_path,
        sim,
        tokenizer_dir,
        sampling=sampling,
        base_url="https://openrouter.example/api/v1",
        provider_routing={"order": ["A"]},
        reasoning={"effort": "high"},
    )
    messages = [{"role": "user", "content": "hi"}]
    chat_req = build_request(cfg, messages)  # type: ignore[arg-type]
    assert chat_req.url == "https://openrouter.example/api/v1/chat/completions"
    assert chat_req.payload == {
        "model": "sim/deepseek-v4-sim",
        "messages": messages,
        "temperature": 0.3,
        "top_p": 0.9,
        "max_tokens": 77,
        "seed": 5,
        "provider": {"order": ["A"]},
        "reasoning": {"effort": "high"},
        "usage": {"include": True},
        "stream": True,  # the default for openai_chat
        "stream_options": {"include_usage": True},
    }
    gen_cfg = make_cfg(tmp_path, sim, tokenizer_dir, sampling=sampling, kind="sglang_generate")
    gen_req = build_request(gen_cfg, messages, tokenizer)  # type: ignore[arg-type]
    assert gen_req.url == f"{sim.base_url}/generate" and endpoint_url(gen_cfg) == gen_req.url
    assert gen_req.payload["input_ids"] == gen_req.prompt_ids == render_prompt_ids(tokenizer, messages)  # type: ignore[arg-type]
    assert gen_req.payload["sampling_params"] == {
        "temperature": 0.3,
        "top_p": 0.9,
        "max_new_tokens": 77,
        "sampling_seed": 5,
        "skip_special_tokens": False,
    }


def test_stop_strings_are_refused() -> None:
    """An answer a stop string ended would be stored with an end-of-turn the model never emitted (an independent
    probe: `code is :` + `<|im_end|>` where SmolLM2 went on with a newline and a code fence)."""
    with pytest.raises(ValidationError, match="end-of-turn the model never emitted"):
        SamplingConfig(stop=["\n"])
    assert SamplingConfig(stop=[]).stop == [] and SamplingConfig().stop is None


def test_completion_split_and_retry_helpers() -> None:
    assert split_completion(f"think{REASONING_CLOSE}answer{EOS}", MARKERS) == ("think", "answer")
    assert split_completion("still thinking", MARKERS) == ("still thinking", "")
    assert split_completion("plain", CompletionMarkers("", EOS)) == (None, "plain")
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after("0.25") == 0.25
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    rng = random.Random(0)
    delays = [backoff_delay(attempt, 0.5, 4.0, rng) for attempt in range(1, 10) for _ in range(20)]
    assert all(0.0 <= d <= 4.0 for d in delays)
    assert max(backoff_delay(1, 0.5, 4.0, rng) for _ in range(50)) <= 0.5


def test_a_raw_answer_that_leaves_out_an_omittable_block_is_content() -> None:
    """Over `/generate`, a thinking-off Bielik-11B-v3 answer (`omit_empty_reasoning`) has no think block: text
    without a close marker that does not open one is the answer, not unfinished reasoning."""
    from dataclasses import replace

    from tasks.reconstruct.completion_format import PRESETS

    fmt = replace(PRESETS["qwen3_thinking"], name="omitting", omit_empty_reasoning=True)
    markers = CompletionMarkers.of(fmt)
    assert split_completion("It is 4.<|im_end|>", markers) == (None, "It is 4.")
    assert split_completion("<think>\nstill thinking", markers) == ("<think>\nstill thinking", "")
    assert split_completion("<think>\nr\n</think>\nIt is 4.<|im_end|>", markers) == ("<think>\nr\n", "\nIt is 4.")
    assert split_completion("still thinking", CompletionMarkers.of(PRESETS["qwen3_thinking"])) == ("still thinking", "")

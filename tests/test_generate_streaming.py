"""Streamed and non-streamed runs of the generate stage over the same long answers write the same rows.

Small scale of `bench/stream_throughput.py`: answers of 300-4,000 tokens in chunks of 1-8, paced over up to a
second, with keep-alive comments, usage in the last chunk, and emoji cut between chunks as UTF-16 halves, from
`endpoint_sim.long_streams` on 127.0.0.1. The idle timeout is shorter than the streams: a stream is alive as long
as chunks keep coming, so every answer must arrive at its first attempt.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from endpoint_sim.long_answers import LongStreamConfig, prompt_tokens
from endpoint_sim.long_streams import LongStreamServer
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, TokenizerConfig
from tasks.common.messages import sample_id
from tasks.common.schemas import PROMPTS
from tasks.common.shards import PartRef, read_part, write_part
from tasks.generate import CompletionMarkers, generate_parts

SERVER = LongStreamConfig(
    pool=12,
    tokens_min=300,
    tokens_max=4000,
    stream_s=1.0,
    pace_spread=0.5,
    first_token_s=0.05,
    write_interval_s=0.02,
    comment_every=8,
)
MARKERS = CompletionMarkers(reasoning_close="</think>", end_of_turn="")
SAMPLES = 16


@pytest.fixture(scope="module")
def long_streams() -> Iterator[LongStreamServer]:
    with LongStreamServer(SERVER) as server:
        yield server


def prompts_part(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for i in range(SAMPLES):
        messages = [{"role": "user", "content": f"[long {i}] Reason at length, then answer."}]
        sid = sample_id("ds", messages)  # type: ignore[arg-type]
        rows.append(
            {
                "sample_id": sid,
                "dataset": "ds",
                "source_file": "prompts.jsonl",
                "source_row": i,
                "messages": messages,
                "prompt_id": sid,
                "sample_index": 0,
            }
        )
    write_part(PartRef(run_dir, "prompts", 0), pa.Table.from_pylist(rows, schema=PROMPTS), provenance={})
    return rows


def run(
    run_dir: Path, server: LongStreamServer, model_dir: Path, stream: bool, **endpoint: Any
) -> dict[str, dict[str, Any]]:
    cfg = PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="ds", path=model_dir)],
        endpoint=EndpointConfig(
            **{
                "base_url": server.base_url,
                "model": "moonshotai/kimi-k2.5",
                "stream": stream,
                "stream_idle_timeout_s": 0.5,
                "max_in_flight": SAMPLES,
                "max_attempts": 1,
                "commit_every_samples": 5,
                **endpoint,
            }
        ),
        tokenizer=TokenizerConfig(path=model_dir),
    )
    generate_parts(cfg, [PartRef(run_dir, "prompts", 0)], MARKERS)
    return {row["sample_id"]: row for row in read_part(PartRef(run_dir, "responses", 0)).to_pylist()}


def test_streamed_rows_equal_the_non_streamed_rows(
    tmp_path: Path, long_streams: LongStreamServer, tokenizer_dir: Path
) -> None:
    prompts = {row["sample_id"]: row for row in prompts_part(tmp_path / "streamed")}
    prompts_part(tmp_path / "whole")
    streamed = run(tmp_path / "streamed", long_streams, tokenizer_dir, stream=True)
    whole = run(tmp_path / "whole", long_streams, tokenizer_dir, stream=False)
    assert list(streamed) == list(whole) == list(prompts)
    stats = long_streams.stats()
    assert stats["streams_finished"] == SAMPLES and stats["non_streamed"] == SAMPLES
    assert stats["data_events"] > 100 * SAMPLES, "the streams were not long"
    split_emoji = 0
    assert all(row["status"] == "done" for row in whole.values())
    for sid, row in streamed.items():
        prompt = prompts[sid]["messages"][0]["content"]
        answer = long_streams.answer_for(prompt)
        split_emoji += answer.ascii_escaped and "\U0001f642" in answer.reasoning
        assert row["attempts"] == 1 and row["status"] == "done"
        assert (row["reasoning"], row["content"]) == (answer.reasoning, answer.content)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt_tokens(prompt), answer.completion_tokens)
        assert row["generation_id"] in stats["ends"]
        other = whole[sid]
        assert {k: v for k, v in row.items() if k not in ("latency_s", "generation_id")} == {
            k: v for k, v in other.items() if k not in ("latency_s", "generation_id")
        }
    assert split_emoji, "no answer had an emoji to cut between chunks"


def test_a_stream_that_keeps_going_past_the_request_timeout_is_cut(
    tmp_path: Path, long_streams: LongStreamServer, tokenizer_dir: Path
) -> None:
    """Chunks keep coming every 20 ms, so the 0.5 s idle timeout never fires (the test above would fail otherwise);
    `request_timeout_s` still bounds the whole answer."""
    prompts_part(tmp_path)
    rows = run(tmp_path, long_streams, tokenizer_dir, stream=True, request_timeout_s=0.3)
    assert len(rows) == SAMPLES
    for row in rows.values():
        assert (row["status"], row["failure_reason"], row["attempts"]) == ("failed", "timeout", 1), row["error"]

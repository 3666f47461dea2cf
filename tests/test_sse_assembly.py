"""The SSE assembler against real long answers: whatever way the bytes are cut, it gives the non-streamed body.

The answers are `endpoint_sim.long_answers`' (thousands of tokens in chunks of 1-8, JSON escapes, CJK, emoji,
ASCII-escaped answers whose emoji are cut between two chunks as UTF-16 halves); the wire variants are the ones the
SSE spec allows and servers send: CRLF or CR line ends, an event spread over several `data:` lines, `data:`
without its space, no blank line after the last event.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from endpoint_sim.long_answers import (
    ID_PLACEHOLDER,
    LongAnswer,
    LongStreamConfig,
    completion_body,
    long_answer,
    render_stream,
    usage,
)
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, TokenizerConfig
from tasks.generate.endpoints import CompletionMarkers, MalformedResponseError, parse_response
from tasks.generate.sse import StreamAssembler

CFG = LongStreamConfig(tokens_min=300, tokens_max=3000)
GEN_ID = "gen-1760000000-00000000000000000042"
MARKERS = CompletionMarkers(reasoning_close="</think>", end_of_turn="")


def pipeline_cfg(tmp_path: Any) -> PipelineConfig:
    return PipelineConfig(
        run_dir=tmp_path,
        datasets=[DatasetConfig(name="ds", path=tmp_path)],
        endpoint=EndpointConfig(model="m", stream=True),
        tokenizer=TokenizerConfig(path=tmp_path),
    )


def wire(index: int, n_prompt: int = 17) -> tuple[LongAnswer, bytes, dict[str, Any]]:
    """An answer, its SSE body as the server sends it, and the same answer non-streamed (as parsed JSON)."""
    answer = long_answer(CFG, index)
    rendered = render_stream(CFG, answer)
    body = (rendered.blob + rendered.ending(usage(CFG, answer, n_prompt))).replace(
        ID_PLACEHOLDER.encode(), GEN_ID.encode()
    )
    return answer, body, json.loads(completion_body(CFG, answer, GEN_ID, n_prompt))


def assemble(body: bytes, cuts: list[int], **hooks: Any) -> StreamAssembler:
    stream = StreamAssembler(**hooks)
    start = 0
    for cut in [*cuts, len(body)]:
        stream.feed(body[start:cut])
        start = cut
    stream.close()
    return stream


def random_cuts(body: bytes, rng: random.Random, most: int) -> list[int]:
    cuts, at = [], 0
    while True:
        at += rng.randint(1, most)
        if at >= len(body):
            return cuts
        cuts.append(at)


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_any_cut_of_a_long_stream_gives_the_non_streamed_result(index: int, tmp_path: Any) -> None:
    answer, body, whole = wire(index)
    assert answer.ascii_escaped == (index % 2 == 1)
    if answer.ascii_escaped:
        assert b"\\ud83d" in body, "the escaped answers must cut an emoji between two chunks"
    cfg = pipeline_cfg(tmp_path)
    expected = parse_response(cfg, whole, MARKERS)
    assert expected.reasoning == answer.reasoning and expected.content == answer.content
    rng = random.Random(index)
    for most in (1, 7, 500, 5000, len(body)):
        stream = assemble(body, random_cuts(body, rng, most) if most > 1 else list(range(1, len(body))))
        assert stream.done and stream.finish_reason == "stop" and stream.error is None
        assert parse_response(cfg, stream.body(), MARKERS) == expected, f"cut at most {most} bytes"


def test_line_ends_multi_line_events_and_a_missing_last_blank_line() -> None:
    _, body, whole = wire(2)
    events = body.split(b"\n\n")
    assert events[-1] == b""
    variants = {
        "crlf": body.replace(b"\n", b"\r\n"),
        "cr": body.replace(b"\n", b"\r"),
        "no space after data:": body.replace(b"data: ", b"data:"),
        # One event's JSON over two data lines, joined again with LF (a JSON whitespace).
        "split data lines": b"\n\n".join(
            e.replace(b'","', b'",\ndata: "', 1) if e.startswith(b"data: {") else e for e in events
        ),
        "no blank line at the end": body.removesuffix(b"\n\n"),
        "no line break at the end": body.removesuffix(b"\n\n").removesuffix(b"\n"),
        "comments between every event": body.replace(b"\n\ndata: ", b"\n\n: OPENROUTER PROCESSING\n\ndata: "),
    }
    message = whole["choices"][0]["message"]
    for name, variant in variants.items():
        for most in (3, 4096):
            stream = assemble(variant, random_cuts(variant, random.Random(name), most))
            got = stream.body()
            assert got["choices"][0]["message"] == message, name
            assert (got["usage"], got["id"], got["provider"]) == (whole["usage"], GEN_ID, whole["provider"]), name
            assert stream.finish_reason == "stop", name


def test_the_generation_id_is_reported_once_with_the_first_chunk_and_choices_reach_the_accumulator() -> None:
    _, body, _ = wire(0)
    first_event_end = body.index(b"\n\n", body.index(b"data: {")) + 2
    seen: list[str] = []
    choices: list[dict[str, Any]] = []
    stream = StreamAssembler(on_generation_id=seen.append, on_choice=choices.append)
    stream.feed(body[: first_event_end - 1])
    assert seen == []
    stream.feed(body[first_event_end - 1 : first_event_end])
    assert seen == [GEN_ID]
    for start in range(first_event_end, len(body), 997):
        stream.feed(body[start : start + 997])
    stream.close()
    assert seen == [GEN_ID]
    assert len(choices) == body.count(b"data: {") - 1  # every chunk but the usage chunk, which has no choices
    reasoning = "".join(c["delta"].get("reasoning") or "" for c in choices)
    assert reasoning == stream.body()["choices"][0]["message"]["reasoning"]


def test_learned_shapes_read_exactly_what_parsing_reads() -> None:
    """Chunks that look like the learned shapes but are not (both texts, empty reasoning beside reasoning_content,
    other spacing, an extra field, a finish, the text repeated under another key) must give what parsing every
    chunk gives (`on_choice` turns shapes off)."""
    envelope = '{"id":"gen-1","provider":"P","model":"m","object":"chat.completion.chunk","created":1,"choices":'
    deltas = [
        {"role": "assistant", "content": "", "reasoning": 'Let "me" think', "reasoning_details": [{"text": "x"}]},
        *(
            {
                "role": "assistant",
                "content": "",
                "reasoning": f" step {i} é \u00e9 \\ \n",
                "reasoning_details": [{"text": "y"}],
            }
            for i in range(5)
        ),
        {"role": "assistant", "content": "both", "reasoning": " and"},
        {"role": "assistant", "content": "", "reasoning": "", "reasoning_content": " via rc"},
        {"role": "assistant", "content": "", "reasoning": "spaced", "reasoning_details": [{"text": "y"}]},
        {"role": "assistant", "content": "", "reasoning": " plain", "reasoning_details": [{"text": "z"}]},
        {"role": "assistant", "content": "", "reasoning": "\ud83d", "reasoning_details": [{"text": "\ud83d"}]},
        {"role": "assistant", "content": "", "reasoning": "\ude42", "reasoning_details": [{"text": "\ude42"}]},
        {"role": "assistant", "content": "Answer", "reasoning": None},
        *({"role": "assistant", "content": f" {i}\t", "reasoning": None} for i in range(4)),
        {"role": "assistant", "content": "Answer", "reasoning": None, "logprobs": {"content": []}},
    ]
    events = []
    for i, delta in enumerate(deltas):
        # ASCII-escaped or UTF-8 as it is, alternately; the UTF-16 halves can only be sent escaped.
        escaped = i % 2 == 0 or i in (10, 11)
        choice = json.dumps(
            [{"index": 0, "delta": delta, "finish_reason": None}], separators=(",", ":"), ensure_ascii=escaped
        )
        if i == 8:
            choice = choice.replace('"reasoning":"spaced"', '"reasoning": "spaced"')
        events.append(f"data: {envelope}{choice}}}\n\n")
    events.append(f'data: {envelope}[{{"index":0,"delta":{{"content":" end"}},"finish_reason":"stop"}}]}}\n\n')
    events.append(f'data: {envelope}[],"usage":{{"prompt_tokens":3,"completion_tokens":9}}}}\n\ndata: [DONE]\n\n')
    body = "".join(events).encode()
    shaped, parsed = StreamAssembler(), StreamAssembler(on_choice=lambda choice: None)
    for stream in (shaped, parsed):
        stream.feed(body)
        stream.close()
    assert shaped._shapes and not parsed._shapes
    assert shaped.body() == parsed.body()
    message = shaped.body()["choices"][0]["message"]
    assert message["reasoning"].startswith('Let "me" think step 0 é é \\ \n step 1')
    assert message["reasoning"].endswith(" and via rcspaced plain\U0001f642")
    assert message["content"] == "bothAnswer 0\t 1\t 2\t 3\tAnswer end"


def test_values_orjson_refuses_are_parsed_as_json_does() -> None:
    stream = StreamAssembler()
    stream.feed(b'data: {"id":"g","choices":[{"delta":{"content":"a\\ud83d"},"finish_reason":null}],"x":NaN}\n\n')
    stream.feed(b'data: {"choices":[{"delta":{"content":"\\ude42b"},"finish_reason":"stop"}]}\n\n')
    stream.close()
    assert stream.body()["choices"][0]["message"]["content"] == "a\U0001f642b"


def test_error_chunks_and_broken_chunks() -> None:
    errored = StreamAssembler()
    errored.feed(b'data: {"id":"g","choices":[{"delta":{"content":"half"},"finish_reason":null}]}\n\n')
    errored.feed(b'data: {"id":"g","error":{"code":502,"message":"Provider disconnected"},"choices":[]}\n\n')
    assert errored.error == {"code": 502, "message": "Provider disconnected"} and errored.generation_id() == "g"
    for broken, what in (
        (b"data: [1, 2]\n\n", "JSON list"),
        (b'data: {"choices": "x"}\n\n', "unexpected shape"),
        (b'data: {"choices":[{"delta":{"content":["a"]}}]}\n\n', "unexpected shape"),
        (b'data: {"choices":[{"delta":{"content":"a"}', "not JSON"),
    ):
        stream = StreamAssembler()
        with pytest.raises(MalformedResponseError, match=what):
            stream.feed(broken)
            stream.close()
    cut = StreamAssembler()
    cut.feed(b'data: {"id":"g","choices":[{"delta":{"content":"a"},"finish_reason":null}]}\n\n')
    cut.close()
    assert cut.finish_reason is None and not cut.done
    ended = StreamAssembler()
    ended.feed(b'data: {"id":"g","choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}\n\n')
    ended.feed(b"data: [DONE]\n\ndata: not JSON, and after the end\n\n")
    assert ended.done and ended.body()["choices"][0]["message"]["content"] == "a"


def test_every_chunks_logprobs_are_kept_once_shapes_are_learned() -> None:
    """Per-token logprobs (`endpoint.logprobs`) ride in chunks that may be byte-identical to earlier ones (the same
    token at the same logprob): such chunks are parsed, never read by a learned shape, so no entry is skipped;
    chunks before them without logprobs still teach shapes."""
    envelope = f'"id":"{GEN_ID}","provider":"P","model":"m","object":"chat.completion.chunk","created":1'
    events = [
        f'data: {{{envelope},"choices":[{{"index":0,"delta":{{"content":"x{i}"}},"logprobs":null}}]}}' for i in range(6)
    ]
    tokens = ["a", "a", "a", " b", "a", "a"]
    for token in tokens:
        entry = {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}
        choice = {"index": 0, "delta": {"content": token}, "logprobs": {"content": [entry]}}
        events.append(f"data: {{{envelope},{json.dumps({'choices': [choice]}, separators=(',', ':'))[1:]}")
    events.append(f'data: {{{envelope},"choices":[{{"index":0,"delta":{{}},"finish_reason":"stop"}}]}}')
    body = ("\n\n".join(events) + "\n\ndata: [DONE]\n\n").encode()
    for most in (1, 7, 4096):
        stream = assemble(body, random_cuts(body, random.Random(most), most))
        assert stream._shapes, "no shape was learned from the chunks without logprobs"
        choice = stream.body()["choices"][0]
        assert choice["message"]["content"] == "".join(f"x{i}" for i in range(6)) + "".join(tokens)
        assert choice["logprobs"] == {"content": [{"token": t, "bytes": list(t.encode())} for t in tokens]}

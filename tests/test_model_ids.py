"""Token-exact data: the ids the model generated are the stored ids, whether the endpoint returns them (SGLang's
/generate `output_ids`, vLLM's chat `token_ids` with the `prompt_token_ids` it rendered) or per-token logprobs with
bytes (OpenAI's shape, streamed and not; llama-cpp-python's without bytes), including answers
whose tokenization re-encoding never gives and a multi-byte character cut across two tokens.

Real parts throughout: the simulator on 127.0.0.1 (backed by the tiny random-weight model, whose free choice of
tokens is non-canonical in most answers, or by the stock generator splitting one token per answer), the DeepSeek-V4
tokenizer, real Parquet parts through generate, reconstruct and validate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from transformers import PreTrainedTokenizerBase

from endpoint_sim.model_backend import ModelResponder
from endpoint_sim.responder import Responder, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, SamplingConfig, TokenizerConfig
from tasks.common.messages import sample_id
from tasks.common.schemas import PROMPTS
from tasks.common.shards import PartRef, read_marker, read_part, write_part
from tasks.generate import CompletionMarkers, generate_parts
from tasks.generate.endpoints import MalformedResponseError, parse_response
from tasks.generate.sse import StreamAssembler
from tasks.generate.token_bytes import ExactIds, LogprobTokens, exact_ids, reported_ids, token_bytes_index
from tasks.reconstruct.completion_format import format_for
from tasks.reconstruct.stage import endpoint_prompt_notice, model_ids_notice, reconstruct_part
from tasks.reconstruct.tokenizer_loading import load_tokenizer
from tasks.validate.checks import validate_part
from tests.test_generate import make_cfg, write_prompts

EOS = "<｜end▁of▁sentence｜>"
SAMPLES = 8


def write_user_prompts(run_dir: Path, texts: list[str]) -> None:
    rows = []
    for i, text in enumerate(texts):
        messages: Any = [{"role": "user", "content": text}]
        sid = sample_id("ds", messages)
        rows.append(
            {"sample_id": sid, "dataset": "ds", "source_file": "prompts.jsonl", "source_row": i}
            | {"messages": messages, "prompt_id": sid, "sample_index": 0}
        )
    write_part(PartRef(run_dir, "prompts", 0), pa.Table.from_pylist(rows, schema=PROMPTS), provenance={})


def run_stages(
    cfg: PipelineConfig, prompts: list[str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, Any]]:
    """generate -> reconstruct -> validate part 0; (responses, tokens by sample id, validation stats)."""
    if prompts is None:
        write_prompts(cfg.run_dir, 0, SAMPLES, "exact")
    else:
        write_user_prompts(cfg.run_dir, prompts)
    tokenizer = load_tokenizer(cfg.tokenizer)
    fmt = format_for(cfg, tokenizer)
    generate_parts(cfg, [PartRef(cfg.run_dir, "prompts", 0)], CompletionMarkers.of(fmt), tokenizer)
    reconstruct_part(cfg, 0, fmt)
    stats = validate_part(cfg, 0, fmt)
    responses = read_part(PartRef(cfg.run_dir, "responses", 0)).to_pylist()
    tokens = {r["sample_id"]: r for r in read_part(PartRef(cfg.run_dir, "tokens", 0)).to_pylist()}
    return responses, tokens, stats


def sent_messages(cfg: PipelineConfig) -> dict[str, list[dict[str, Any]]]:
    """Each sample's request messages: its prompt without a trailing assistant turn, which is never sent."""
    rows = read_part(PartRef(cfg.run_dir, "prompts", 0)).to_pylist()
    return {p["sample_id"]: [m for m in p["messages"] if m["role"] != "assistant"] for p in rows}


def completion(row: dict[str, Any]) -> list[int]:
    ids: list[int] = row["input_ids"][row["prompt_len"] :]
    return ids


def test_generate_route_stores_the_ids_the_model_generated(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Every stored completion is the model's own decode, ids for ids; most of them re-encode differently."""
    sim_config = SimConfig(reasoning_words=(16, 24), content_words=(16, 24))
    responder = ModelResponder(tiny_model_dir, sim_config, temperature=1.0)  # seeded per prompt: varied tokens
    with SimulatorServer(tiny_model_dir, responder.config, responder=responder) as sim:
        cfg = make_cfg(tmp_path, sim, tiny_model_dir, kind="sglang_generate")
        responses, tokens, stats = run_stages(cfg)
    assert len(responses) == SAMPLES and all(r["status"] == "done" for r in responses)
    validation = {r["sample_id"]: r for r in read_part(PartRef(cfg.run_dir, "validation", 0)).to_pylist()}
    non_canonical = 0
    for response in responses:
        generated = list(responder.sample(tuple(response["prompt_ids"]), response["request_seed"]).output_ids)
        row = tokens[response["sample_id"]]
        assert completion(row) == generated, response["sample_id"]
        assert row["token_source"] == "model"
        check = validation[response["sample_id"]]
        assert check["token_source"] == "model" and "model_ids_mismatch" not in check["structural_issues"]
        non_canonical += check["reference_match"] == "bpe_artifact"
        assert check["reference_match"] in ("exact", "bpe_artifact") and check["verdict"] != "fail"
    assert non_canonical >= 1, "the tiny model's free choice of tokens re-encodes differently in some answers"
    assert stats["model_rows"] == SAMPLES and stats["reencoded_rows"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_bytes_rebuild_the_exact_ids(tmp_path: Path, tokenizer_dir: Path, stream: bool) -> None:
    """Chat completions with logprobs: every answer's reference split is non-canonical (one token replaced by
    two with the same bytes); the stored ids are that split, rebuilt from the bytes, streamed or not."""
    sim_config = SimConfig(noncanonical_rate=1.0, tool_call_rate=0.0)
    responder = Responder(tokenizer_dir, sim_config)
    with SimulatorServer(tokenizer_dir, sim_config, responder=responder) as sim:
        cfg = make_cfg(tmp_path, sim, tokenizer_dir, stream=stream, logprobs=True)
        responses, tokens, stats = run_stages(cfg)
    assert all(r["status"] == "done" for r in responses)
    tokenizer = load_tokenizer(cfg.tokenizer)
    split = 0
    sent = sent_messages(cfg)
    for response in responses:
        sample = responder.sample_for_messages(sent[response["sample_id"]])
        assert response["output_ids"] == list(sample.output_ids[:-1])  # logprobs leave out the end of turn
        row = tokens[response["sample_id"]]
        assert completion(row) == list(sample.output_ids) and row["token_source"] == "model"
        split += sample.noncanonical
        assert tokenizer.decode(completion(row)) == sample.text + EOS
    assert split >= SAMPLES // 2 and stats["model_rows"] == SAMPLES


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_token_ids_are_the_stored_ids(tmp_path: Path, tokenizer_dir: Path, stream: bool) -> None:
    """Chat completions with vLLM's `return_token_ids`: every answer's split is non-canonical; the stored
    completion is the ids the server reported (its stop token last), and the prompt ids it rendered are kept and
    equal ours, streamed (ids per chunk, the prompt's in the first) or not."""
    sim_config = SimConfig(noncanonical_rate=1.0, tool_call_rate=0.0)
    responder = Responder(tokenizer_dir, sim_config)
    with SimulatorServer(tokenizer_dir, sim_config, responder=responder) as sim:
        cfg = make_cfg(tmp_path, sim, tokenizer_dir, stream=stream, return_token_ids=True)
        responses, tokens, stats = run_stages(cfg)
    assert all(r["status"] == "done" for r in responses)
    requests = sent_messages(cfg)
    split = 0
    for response in responses:
        sent = requests[response["sample_id"]]
        sample = responder.sample_for_messages(sent)
        assert response["output_ids"] == list(sample.output_ids[:-1])  # the stop token is reconstruct's to add
        assert response["prompt_ids"] == list(responder.prompt_ids_for_messages(sent))
        row = tokens[response["sample_id"]]
        assert completion(row) == list(sample.output_ids) and row["token_source"] == "model"
        assert row["input_ids"][: row["prompt_len"]] == response["prompt_ids"]
        split += sample.noncanonical
    assert split >= SAMPLES // 2 and stats["model_rows"] == SAMPLES


def test_a_prompt_the_server_rendered_otherwise_is_the_stored_prompt(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A server that renders the prompt otherwise than the configured template (here: a system prompt of its
    own) reports the prompt ids the target really read: those are the row's prompt, not ours, so the stored row
    is what the target read and wrote (the billed prompt tokens agree with it), and one line says how many rows
    differ from the configured template."""
    injected = "You are a helpful assistant."
    sim_config = SimConfig(tool_call_rate=0.0, injected_system_prompt=injected)
    responder = Responder(tokenizer_dir, sim_config)
    with SimulatorServer(tokenizer_dir, sim_config, responder=responder) as sim:
        cfg = make_cfg(tmp_path, sim, tokenizer_dir, return_token_ids=True)
        responses, tokens, _ = run_stages(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    requests = sent_messages(cfg)
    for response in responses:
        sent = requests[response["sample_id"]]
        served = list(responder.prompt_ids_for_messages(sent))
        row = tokens[response["sample_id"]]
        assert row["input_ids"][: row["prompt_len"]] == served == response["prompt_ids"]
        assert completion(row) == list(responder.sample(tuple(served), None).output_ids)
        if sent[0]["role"] != "system":  # the server's own system prompt is in the stored prompt
            assert injected in tokenizer.decode(served)
    validation = read_part(PartRef(cfg.run_dir, "validation", 0)).to_pylist()
    assert {v["prompt_match"] for v in validation} == {"exact"} and {v["verdict"] for v in validation} == {"pass"}
    stats = read_marker(PartRef(cfg.run_dir, "tokens", 0))["stats"]
    differing = sum(messages[0]["role"] != "system" for messages in requests.values())
    assert differing and stats["endpoint_prompt_rows"] == differing
    notice = endpoint_prompt_notice([stats])
    assert notice is not None and notice.startswith(f"{differing} of {SAMPLES} rows store the prompt ids")
    assert endpoint_prompt_notice([{**stats, "endpoint_prompt_rows": 0}]) is None


def test_token_ids_of_another_text_are_the_reference_and_the_run_says_so(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A server whose returned text is not what its ids spell (here: a word changed after sampling): the row
    stores a re-encoding of the text, the reported ids stay its reference (as /generate's output_ids do), so
    validation classifies the difference, and one line says how many rows asked for ids and got a re-encoding."""
    sim_config = SimConfig(text_mismatch_rate=1.0, tool_call_rate=0.0)
    responder = Responder(tokenizer_dir, sim_config)
    with SimulatorServer(tokenizer_dir, sim_config, responder=responder) as sim:
        cfg = make_cfg(tmp_path, sim, tokenizer_dir, stream=False, return_token_ids=True)
        responses, tokens, _ = run_stages(cfg)
    requests = sent_messages(cfg)
    for response in responses:
        sent = requests[response["sample_id"]]
        assert response["output_ids"] == list(responder.sample_for_messages(sent).output_ids)
        assert tokens[response["sample_id"]]["token_source"] == "reencoded"
    validation = read_part(PartRef(cfg.run_dir, "validation", 0)).to_pylist()
    assert {v["reference_match"] for v in validation} == {"real_difference"}
    stats = read_marker(PartRef(cfg.run_dir, "tokens", 0))["stats"]
    notice = model_ids_notice(cfg, [stats])
    assert notice is not None and notice.startswith(f"{SAMPLES} of {SAMPLES} rows store a re-encoding")
    assert "endpoint.return_token_ids" in notice
    assert model_ids_notice(cfg, [{**stats, "reencoded_rows": 0}]) is None


def test_token_ids_that_do_not_spell_the_answer_are_not_the_rows_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    """Ids are taken only when they spell the text the answer carries: a stop token other than the end of turn,
    an id outside the vocabulary or a text changed after sampling leaves the row to re-encoding; malformed ids
    are a malformed response."""
    text = "Zürich NORTH"
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    assert reported_ids([*ids, eos], tokenizer, "", text, "</think>", EOS) == ExactIds(ids)
    assert reported_ids(ids, tokenizer, "", text, "</think>", EOS) == ExactIds(ids)
    assert reported_ids([*ids, eos, eos], tokenizer, "", text, "</think>", EOS) is None
    assert reported_ids([*ids, len(tokenizer) + 7], tokenizer, "", text, "</think>", EOS) is None
    assert reported_ids(ids, tokenizer, "", text + "!", "</think>", EOS) is None
    cfg = PipelineConfig(
        run_dir=Path("unused"),
        datasets=[DatasetConfig(name="ds", path=Path("unused.jsonl"))],
        endpoint=EndpointConfig(model="m", return_token_ids=True),
        tokenizer=TokenizerConfig(path=Path(tokenizer.name_or_path)),
    )
    body = {"id": "g", "choices": [{"message": {"content": text}, "token_ids": ["1"], "finish_reason": "stop"}]}
    with pytest.raises(MalformedResponseError, match="token_ids must be a list of integers"):
        parse_response(cfg, body, CompletionMarkers("</think>", EOS), tokenizer=tokenizer)
    generate_route = {"model": "m", "kind": "sglang_generate", "return_token_ids": True}
    with pytest.raises(ValueError, match="return_token_ids applies to openai_chat"):
        PipelineConfig.model_validate({**cfg.model_dump(), "endpoint": generate_route})


def test_without_logprobs_the_text_is_reencoded(tmp_path: Path, tokenizer_dir: Path) -> None:
    sim_config = SimConfig(noncanonical_rate=1.0, tool_call_rate=0.0)
    with SimulatorServer(tokenizer_dir, sim_config) as sim:
        cfg = make_cfg(tmp_path, sim, tokenizer_dir)
        responses, tokens, stats = run_stages(cfg)
    assert all(r["output_ids"] is None for r in responses)
    assert {row["token_source"] for row in tokens.values()} == {"reencoded"}
    assert stats["reencoded_rows"] == SAMPLES and stats["model_rows"] == 0


def test_bytes_map_split_characters_and_non_canonical_pieces(tokenizer: PreTrainedTokenizerBase) -> None:
    """Hand-built logprobs: "ü" as its two single-byte tokens (neither decodes alone) and " NORTH" (one token)
    as " " + "NOR" + "TH"; the bytes give exactly those ids, a stream fed chunk by chunk gives the same, and text
    the logprobs do not spell is refused."""
    index = token_bytes_index(tokenizer)
    text = "Zürich NORTH"
    pieces = [b"Z", b"\xc3", b"\xbc", b"rich", b" ", b"NOR", b"TH"]
    expected = [index.by_bytes[p] for p in pieces]
    assert tokenizer.decode(expected) == text and tokenizer.encode(text, add_special_tokens=False) != expected
    assert "\ufffd" in tokenizer.decode([index.by_bytes[b"\xc3"]])
    entries = [{"token": p.decode("utf-8", errors="replace"), "logprob": -0.1, "bytes": list(p)} for p in pieces]

    whole = LogprobTokens()
    whole.feed({"content": entries})
    assert exact_ids(whole, tokenizer, "", text, "</think>") == ExactIds(expected)
    assert exact_ids(whole, tokenizer, "", text + "!", "</think>") is None  # the text was changed afterwards

    stream = StreamAssembler()
    for e in entries:
        chunk = {"id": "g", "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": {"content": [e]}}]}
        stream.feed(f"data: {json.dumps(chunk)}\n\n".encode())
    stream.feed(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
    fed = LogprobTokens()
    fed.feed(stream.body()["choices"][0]["logprobs"])
    assert exact_ids(fed, tokenizer, "", text, "</think>") == ExactIds(expected)

    reasoning = LogprobTokens()
    close = {"token": "</think>", "logprob": 0.0, "bytes": list(b"</think>")}
    reasoning.feed({"content": [entries[0], close, *entries[1:]]})
    ids = exact_ids(reasoning, tokenizer, "Z", "ürich NORTH", "</think>")
    assert ids is not None and ids.ids == [expected[0], tokenizer.convert_tokens_to_ids("</think>"), *expected[1:]]


def test_logprobs_without_bytes_as_llama_cpp_python_serves_them(tokenizer: PreTrainedTokenizerBase) -> None:
    """llama-cpp-python's chat completions (0.3.36, `_convert_text_completion_logprobs_to_chat`) send `"bytes":
    null` and each token as its own detokenized text decoded with errors="ignore". Whole-character tokens still
    name their ids (a non-canonical split included); a character cut across two tokens leaves text that names
    no token, and the answer is re-encoded rather than stored with ids the model never emitted."""
    index = token_bytes_index(tokenizer)

    def served(pieces: list[bytes]) -> LogprobTokens:
        tokens = LogprobTokens()
        tokens.feed({"content": [{"token": p.decode("utf-8", errors="ignore"), "bytes": None} for p in pieces]})
        return tokens

    whole = [b"The", b" NOR", b"TH", b" pole"]
    ids = [index.by_bytes[p] for p in whole]
    assert ids != tokenizer.encode("The NORTH pole", add_special_tokens=False)
    assert exact_ids(served(whole), tokenizer, "", "The NORTH pole", "</think>") == ExactIds(ids)
    cut = [b"Z", b"\xc3", b"\xbc", b"rich"]
    assert all(p in index.by_bytes for p in cut)
    assert exact_ids(served(cut), tokenizer, "", "Zürich", "</think>") is None


def test_keep_length_truncated_also_passes_validation(tmp_path: Path, tokenizer_dir: Path) -> None:
    """One setting: a kept truncated answer is not failed later by `validation.allowed_finish_reasons`."""
    with SimulatorServer(tokenizer_dir, SimConfig(tool_call_rate=0.0)) as sim:
        cfg = make_cfg(tmp_path, sim, tokenizer_dir, keep_length_truncated=True, sampling=SamplingConfig(max_tokens=12))
        assert cfg.allowed_finish_reasons == ["stop", "length"]
        responses, _, stats = run_stages(cfg)
    assert {r["finish_reason"] for r in responses} == {"length"} and all(r["status"] == "done" for r in responses)
    assert stats["fail"] == 0 and stats["rows"] == SAMPLES
    plain = EndpointConfig(model="m")
    assert (
        "length"
        not in PipelineConfig.model_validate(
            {**cfg.model_dump(), "endpoint": plain.model_dump()}
        ).allowed_finish_reasons
    )


def test_a_retry_gets_the_answer_a_client_gave_up_on(tiny_model_dir: Path) -> None:
    """A client that times out cancels its handler; the decode it queued must still serve the retry (it used to
    be cancelled with the handler, and every retry of that prompt was then dropped: ServerDisconnected)."""
    import httpx

    responder = ModelResponder(tiny_model_dir, SimConfig(reasoning_words=(4, 6), content_words=(4, 6)))
    prompt = list(responder.prompt_ids_for_messages([{"role": "user", "content": "Patience, please."}]))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 64}}
    with SimulatorServer(tiny_model_dir, responder.config, responder=responder) as sim:
        # the batch worker cannot decode until the first client has given up
        with responder.lock, pytest.raises(httpx.TimeoutException):
            httpx.post(f"{sim.base_url}/generate", json=body, timeout=0.5)
        reply = httpx.post(f"{sim.base_url}/generate", json=body, timeout=60)
    assert reply.status_code == 200
    assert reply.json()["output_ids"] == list(responder.sample(tuple(prompt), None).output_ids)


def test_a_decode_stops_at_the_request_limit_and_a_higher_limit_decodes_again(tiny_model_dir: Path) -> None:
    """The backend decodes up to the request's limit, not its own cap (64 asked of a 512-token cap cost 8x),
    and a cut answer is not served to a request that allows more: that one is decoded again, same prefix."""
    responder = ModelResponder(tiny_model_dir, SimConfig(), stop="model", max_new_tokens=48)
    prompt = responder.prompt_ids_for_messages([{"role": "user", "content": "Count to ten."}])
    decoded: list[int] = []
    decode = responder._decode

    def counting(rows: list[Any]) -> None:
        decoded.extend(row.cap for row in rows)
        decode(rows)

    responder._decode = counting  # type: ignore[method-assign]
    short = responder.sample(prompt, None, limit=8)
    assert len(short.output_ids) <= 8 and decoded == [8]
    assert responder.sample(prompt, None, limit=5) is short  # a lower limit is served from the cut answer
    longer = responder.sample(prompt, None, limit=20)
    assert decoded == [8, 20]
    if not short.finished:
        assert len(short.output_ids) == 8 and longer.output_ids[:8] == short.output_ids
    uncapped = responder.sample(prompt, None)
    assert decoded[-1] == 48 and uncapped.output_ids[: len(longer.output_ids)] == longer.output_ids

"""A model may write the characters of a control token as ordinary tokens: SmolLM2 asked to copy `<|im_end|>`
wrote it as `Ġ< | im _ end | >` and then its real end-of-turn id; a thinking model explaining the `</think>` tag
writes it inside its reasoning. That text is the model's. Only the control ids say where the turn and the
reasoning end (an independent probe on SmolLM2-135M-Instruct, 2026-12-04, found the client stripping such text,
storing re-encoded ids and failing the row). Here with the DeepSeek-V4 tokenizer: its end of turn is
`<｜end▁of▁sentence｜>`, and `</think>` is a control id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from transformers import PreTrainedTokenizerBase

from tasks.common.config import (
    DatasetConfig,
    EndpointConfig,
    PipelineConfig,
    ReconstructConfig,
    TokenizerConfig,
    ValidationConfig,
)
from tasks.common.schemas import RESPONSES
from tasks.generate import CompletionMarkers
from tasks.generate.endpoints import GenerationResult, parse_response
from tasks.reconstruct.completion_format import PRESETS, CompletionFormat, resolve_format
from tasks.reconstruct.stage import SampleText, build_tokens_table
from tasks.reconstruct.tokenizer_backend import backend_for
from tasks.validate.checks import exclusion_reasons, validate_tables, verdict

EOS = "<｜end▁of▁sentence｜>"
USER: Any = [{"role": "user", "content": "Copy this exactly: <｜end▁of▁sentence｜>"}]
NO_THINKING = {"thinking": False}


def plain(tokenizer: PreTrainedTokenizerBase, *pieces: str) -> list[int]:
    """The pieces' ids one after another: a piece holding part of a control token's string is ordinary tokens, as
    a model writes them (`split_special_tokens=True` is not used: it leaves the shared tokenizer splitting them)."""
    return [t for piece in pieces for t in tokenizer.encode(piece, add_special_tokens=False)]


@pytest.fixture(scope="module")
def generate_cfg(tokenizer_dir: Path) -> PipelineConfig:
    return PipelineConfig(
        run_dir=Path("unused"),
        datasets=[DatasetConfig(name="d", path=tokenizer_dir)],
        endpoint=EndpointConfig(model="m", kind="sglang_generate"),
        tokenizer=TokenizerConfig(path=tokenizer_dir),
    )


def generate(
    cfg: PipelineConfig,
    tokenizer: PreTrainedTokenizerBase,
    markers: CompletionMarkers,
    text: str,
    output_ids: list[int] | None,
    finish: str,
) -> GenerationResult:
    meta = {"id": "x", "prompt_tokens": 3, "finish_reason": {"type": finish}}
    return parse_response(cfg, {"text": text, "output_ids": output_ids, "meta_info": meta}, markers, None, tokenizer)


def literal_answer(tokenizer: PreTrainedTokenizerBase) -> tuple[str, list[int]]:
    """The answer's text and the model's ids for it, the end-of-turn characters written as ordinary tokens."""
    ids = plain(tokenizer, "It is <", EOS[1:])
    assert tokenizer.convert_tokens_to_ids(EOS) not in ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "It is " + EOS
    return text, ids


def test_generate_keeps_end_of_turn_characters_the_model_wrote(
    generate_cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The text ends with the end-of-turn string whether the server trimmed the real stop token (then the string
    is the model's text) or kept it (then it is the id's text, after the model's): only the second is removed.
    An answer cut by `max_tokens` right after such text stays cut: no end of turn is invented, and without ids a
    "length" answer is never taken for a finished one."""
    text, ids = literal_answer(tokenizer)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    markers = CompletionMarkers("", EOS)
    trimmed = generate(generate_cfg, tokenizer, markers, text, [*ids, eos], "stop")
    kept = generate(generate_cfg, tokenizer, markers, text + EOS, [*ids, eos], "stop")
    assert (trimmed.content, kept.content) == (text, text)
    cut = generate(generate_cfg, tokenizer, markers, text, ids, "length")
    assert (cut.finish_reason, cut.content) == ("length", text)
    assert generate(generate_cfg, tokenizer, markers, text, None, "length").finish_reason == "length"
    assert generate(generate_cfg, tokenizer, markers, "It is" + EOS, [*ids[:2], eos], "length").finish_reason == "stop"


def test_a_row_ending_in_end_of_turn_characters_stores_the_models_ids_and_passes(
    generate_cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Finished (the real end-of-turn id after the text) and cut by `max_tokens` right after the text (ids rebuilt
    from logprobs, the end-of-turn characters last): both rows are the model's ids and pass. The re-encoding of
    the text gives the end-of-turn id for those characters: a cut answer's last id then is not one the layout
    added, and dropping it for the comparison made the re-encoding a real difference and failed the row."""
    fmt = resolve_format("auto", tokenizer, NO_THINKING)
    assert not fmt.has_reasoning
    text, ids = literal_answer(tokenizer)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    finished = generate(generate_cfg, tokenizer, CompletionMarkers.of(fmt), text, [*ids, eos], "stop")
    assert finished.content == text
    samples = [
        SampleText(
            "done", "d", USER, None, finished.content, finished.finish_reason, None, output_ids=finished.output_ids
        ),
        SampleText("cut", "d", USER, None, text, "length", None, output_ids=ids),
    ]
    tokens, stats = build_tokens_table(tokenizer, fmt, samples, ReconstructConfig(), NO_THINKING)
    rows = {r["sample_id"]: r for r in tokens.to_pylist()}
    assert rows["done"]["input_ids"][rows["done"]["prompt_len"] :] == [*ids, eos]
    assert rows["cut"]["input_ids"][rows["cut"]["prompt_len"] :] == ids
    assert stats["model_rows"] == 2
    responses = pa.Table.from_pylist(
        [
            {"sample_id": s.sample_id, "dataset": "d", "status": "done", "content": s.content}
            | {"finish_reason": s.finish_reason, "attempts": 1, "output_ids": s.output_ids}
            for s in samples
        ],
        schema=RESPONSES,
    )
    vcfg = ValidationConfig(allowed_finish_reasons=["stop", "length"])
    table, _ = validate_tables(tokens, responses, fmt, backend_for(tokenizer), vcfg)
    checks = {r["sample_id"]: r for r in table.to_pylist()}
    for sid in ("done", "cut"):
        assert checks[sid]["verdict"] == "pass", checks[sid]
        assert checks[sid]["reference_match"] == "bpe_artifact", checks[sid]


def test_a_reencoding_difference_does_not_fail_a_row_of_the_models_ids() -> None:
    """Its ids equal the endpoint's (else `model_ids_mismatch` fails it) and decode to the answer's text; the
    re-encoding's difference is what re-encoding alone would have stored, reported in `reference_match`. A row
    that stores the re-encoding still fails on it."""
    vcfg = ValidationConfig()
    assert verdict("real_difference", [], False, vcfg, stored_exact=True) == "pass"
    assert exclusion_reasons(["model_ids_mismatch"], "real_difference", vcfg, True) == ["model_ids_mismatch"]
    assert verdict("real_difference", [], False, vcfg) == "fail"
    assert exclusion_reasons([], "real_difference", vcfg) == ["real_difference"]
    assert verdict("exact", ["model_ids_mismatch"], False, vcfg, stored_exact=True) == "fail"


def thinking(tokenizer: PreTrainedTokenizerBase) -> CompletionFormat:
    fmt = PRESETS["deepseek_v4_thinking"]
    assert tokenizer.convert_tokens_to_ids(fmt.reasoning_close) != tokenizer.unk_token_id
    return fmt


def test_generate_splits_reasoning_at_the_close_id_not_at_close_characters(
    generate_cfg: PipelineConfig, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Reasoning that mentions `</think>` (ordinary tokens), then the close id, then the content: the split is at
    the id, so the reasoning keeps its text, the content is the answer, and the model's ids are the row with the
    content starting after the close id. Ids without the close id are reasoning that never finished."""
    fmt = thinking(tokenizer)
    close = tokenizer.convert_tokens_to_ids(fmt.reasoning_close)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    before, after, content = "The user asks what the ", " tag does.", "It ends the reasoning."
    reasoning_ids = plain(tokenizer, before + "</", "think>" + after)
    assert close not in reasoning_ids
    ids = [*reasoning_ids, close, *plain(tokenizer, content), eos]
    text = tokenizer.decode(ids[:-1], skip_special_tokens=False)
    markers = CompletionMarkers.of(fmt)
    res = generate(generate_cfg, tokenizer, markers, text, ids, "stop")
    assert (res.reasoning, res.content) == (before + "</think>" + after, content)
    assert res.reasoning_tokens == len(reasoning_ids)
    unfinished = generate(generate_cfg, tokenizer, markers, tokenizer.decode(reasoning_ids), reasoning_ids, "length")
    assert (unfinished.reasoning, unfinished.content) == (before + "</think>" + after, "")

    kwargs = {"thinking": True}
    sample = SampleText("s", "d", USER, res.reasoning, res.content, res.finish_reason, None, output_ids=ids)
    tokens, stats = build_tokens_table(tokenizer, fmt, [sample], ReconstructConfig(), kwargs)
    row = tokens.to_pylist()[0]
    assert stats["model_rows"] == 1
    assert row["input_ids"][row["prompt_len"] :] == ids
    assert row["reasoning_len"] == len(reasoning_ids) + 1


def test_close_characters_the_model_wrote_do_not_fail_a_row_of_its_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    """`</think>` written as ordinary tokens in the reasoning (or in the answer, after the close id) is the
    model's text when its row is its own ids: the sections' ids hold no close id beyond the layout's, so the row
    passes. The same text re-encoded gets the close id there, and still fails; so do the same ids split at the
    written characters (a reasoning parser that split by text): the content's ids then hold the close id."""
    fmt = thinking(tokenizer)
    close = tokenizer.convert_tokens_to_ids(fmt.reasoning_close)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    reasoning, content = "What the </think> tag does.", "It ends the reasoning, unlike a </think> in text."
    ids = [*plain(tokenizer, "What the </", "think> tag does."), close]
    ids += [*plain(tokenizer, "It ends the reasoning, unlike a </", "think> in text."), eos]
    samples = [
        SampleText("model", "d", USER, reasoning, content, "stop", None, output_ids=ids),
        SampleText("reencoded", "d", USER, reasoning, content, "stop", None),
        SampleText("split_early", "d", USER, "What the ", " tag does.</think>" + content, "stop", None, output_ids=ids),
    ]
    tokens, _ = build_tokens_table(tokenizer, fmt, samples, ReconstructConfig(), {"thinking": True})
    assert [r["token_source"] for r in tokens.to_pylist()] == ["model", "reencoded", "model"]
    responses = pa.Table.from_pylist(
        [
            {"sample_id": s.sample_id, "dataset": "d", "status": "done", "reasoning": s.reasoning}
            | {"content": s.content, "finish_reason": "stop", "attempts": 1, "output_ids": s.output_ids}
            for s in samples
        ],
        schema=RESPONSES,
    )
    table, _ = validate_tables(tokens, responses, fmt, backend_for(tokenizer), ValidationConfig())
    checks = {r["sample_id"]: r for r in table.to_pylist()}
    assert checks["model"]["verdict"] == "pass", checks["model"]
    assert checks["reencoded"]["verdict"] == "fail"
    assert {"close_tag_in_reasoning", "close_tag_in_content"} <= set(checks["reencoded"]["structural_issues"])
    assert checks["split_early"]["verdict"] == "fail"
    assert "close_tag_in_content" in checks["split_early"]["structural_issues"]

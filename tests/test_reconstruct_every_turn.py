"""Reconstruction and validation of conversations regenerated turn by turn (`history` rows), mixed with final-turn
rows in one real Parquet part, over the DeepSeek-V4 tokenizer and the DeepSeek-V3.1 thinking template (which
drops earlier reasoning): ids are the final request's context plus the final answer, loss covers exactly what
the target wrote, prompt order holds, and the endpoint's own ids are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from transformers import PreTrainedTokenizerBase

from tasks.common.errors import ReconstructionError
from tasks.common.messages import Message, prompt_messages, sample_id
from tasks.common.schemas import PROMPTS, RESPONSES
from tasks.common.shards import PartRef, read_part, write_part
from tasks.generate.token_bytes import token_bytes_index
from tasks.reconstruct.completion_format import PRESETS, completion_text
from tasks.reconstruct.multiturn import ConversationTurn, template_messages
from tasks.reconstruct.stage import reconstruct_part
from tasks.reconstruct.tokenizer_loading import render_prompt, render_prompt_ids
from tasks.validate.checks import validate_part
from tests.test_reconstruct import DATASET, make_cfg

DEMO = PRESETS["deepseek_v4_thinking"]
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"


def sid_of(conv: list[Message]) -> str:
    return sample_id(DATASET, prompt_messages(conv))


def user(text: str) -> ConversationTurn:
    return {"role": "user", "content": text, "reasoning": None, "generated": False}


def answer(content: str, reasoning: str) -> ConversationTurn:
    return {"role": "assistant", "content": content, "reasoning": reasoning, "generated": True}


def write_part_inputs(run_dir: Path, part: int, convs: list[list[Message]], responses: list[dict[str, Any]]) -> None:
    prompts = [
        {
            "sample_id": sid_of(conv),
            "dataset": DATASET,
            "source_file": "in.jsonl",
            "source_row": i,
            "messages": [dict(m) for m in conv],
            "prompt_id": sid_of(conv),
            "sample_index": 0,
        }
        for i, conv in enumerate(convs)
    ]
    write_part(PartRef(run_dir, "prompts", part), pa.Table.from_pylist(prompts, schema=PROMPTS), {})
    write_part(PartRef(run_dir, "responses", part), pa.Table.from_pylist(responses, schema=RESPONSES), {})


def response(
    conv: list[Message], reasoning: str, content: str, history: list[ConversationTurn] | None = None, **overrides: Any
) -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name in RESPONSES.names}
    row.update(sample_id=sid_of(conv), dataset=DATASET, status="done", reasoning=reasoning, content=content)
    row.update(finish_reason="stop", attempts=1, provider="sim", request_seed=7, history=history)
    row.update(overrides)
    return row


# Dataset conversations. Every-turn rows answer each user turn; the dataset's own assistant turns are replaced.
PRIME = [
    Message(role="system", content="Be terse."),
    Message(role="user", content="Name a prime."),
    Message(role="assistant", content="2 (the dataset's answer)"),
    Message(role="user", content="Another one, in words?"),
]
GREETING = [Message(role="user", content="Say hi 👋 in French."), Message(role="assistant", content="Salut")]
NOR = [Message(role="user", content="What is a NOR gate?")]
COLOURS = [
    Message(role="user", content="Name a colour."),
    Message(role="user", content="Name another."),
    Message(role="user", content="And a third, in German?"),
]

TWO_COLOURS = [*COLOURS[:2], Message(role="assistant", content="Green."), COLOURS[2]]

PRIME_HISTORY = [
    {"role": "system", "content": "Be terse.", "reasoning": None, "generated": False},
    user("Name a prime."),
    answer("Seven.", "Small primes: 2, 3, 5, 7."),
    user("Another one, in words?"),
]
COLOURS_HISTORY = [
    user("Name a colour."),
    answer("Red.", "Any colour works."),
    user("Name another."),
    answer("Blue 🔵.", "Not red again."),
    user("And a third, in German?"),
]


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert isinstance(text, str)
    return text


def pieces_to_ids(tokenizer: PreTrainedTokenizerBase, pieces: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Each piece meets its neighbours at a control token, so encoding pieces apart gives the whole's ids."""
    ids: list[int] = []
    mask: list[int] = []
    for text, masked in pieces:
        piece = encode(tokenizer, text)
        ids += piece
        mask += [masked] * len(piece)
    return ids, mask


def mixed_part(run_dir: Path, part: int) -> tuple[list[list[Message]], list[dict[str, Any]]]:
    convs = [NOR, PRIME, GREETING, COLOURS]
    rows = [
        response(NOR, "Logic gates.", "A NOR gate outputs 1 only when all inputs are 0."),
        response(PRIME, "Next after 7 is 11.", "Eleven.", PRIME_HISTORY),
        response(GREETING, "Simple greeting.", "Salut 👋 !"),
        response(COLOURS, "Blau is blue; pick green.", "Grün.", COLOURS_HISTORY),
    ]
    write_part_inputs(run_dir, part, convs, [rows[i] for i in (3, 0, 2, 1)])  # completion order != prompt order
    return convs, rows


def test_mixed_part_keeps_prompt_order_and_ids_are_the_regenerated_conversation(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    convs, responses = mixed_part(tmp_path, 0)
    stats = reconstruct_part(cfg, 0, DEMO)
    rows = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()

    assert [r["sample_id"] for r in rows] == [sid_of(c) for c in convs]
    for row, resp in zip(rows, responses, strict=True):
        final = completion_text(DEMO, resp["reasoning"], resp["content"])
        history = resp["history"]
        if history is None:
            context = render_prompt(tokenizer, prompt_messages(next(c for c in convs if sid_of(c) == row["sample_id"])))
        else:
            context = render_prompt(tokenizer, [{"role": t["role"], "content": t["content"]} for t in history])
        ids, p = row["input_ids"], row["prompt_len"]
        assert decode(tokenizer, ids) == context + final
        assert decode(tokenizer, ids[:p]) == context
        assert p + row["completion_len"] == len(ids) == len(row["loss_mask"])
        assert row["reasoning_len"] == len(encode(tokenizer, f"{resp['reasoning']}</think>"))
        assert row["completion_format"] == DEMO.name

    # The earlier answers' reasoning was never in a request (the template drops it): it is nowhere in the ids.
    assert "Small primes" not in decode(tokenizer, rows[1]["input_ids"])
    assert "Not red again" not in decode(tokenizer, rows[3]["input_ids"])
    assert stats["rows"] == 4 and stats["multiturn_rows"] == 2 and stats["responses_not_done"] == 0
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["prompt_tokens"] == sum(r["prompt_len"] for r in rows)
    assert stats["reasoning_tokens"] == sum(r["reasoning_len"] for r in rows)
    assert stats["loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows)


def test_loss_covers_exactly_the_targets_own_spans(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    mixed_part(tmp_path, 0)
    reconstruct_part(make_cfg(tmp_path, tokenizer_dir), 0, DEMO)
    rows = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()
    prime, colours = rows[1], rows[3]

    ids, mask = pieces_to_ids(
        tokenizer,
        [
            (f"{BOS}Be terse.{USER}Name a prime.{ASSISTANT}</think>", 0),
            ("Seven.", 1),
            (EOS, 1),
            (f"{USER}Another one, in words?{ASSISTANT}<think>", 0),
            ("Next after 7 is 11.</think>", 1),
            ("Eleven.", 1),
            (EOS, 1),
        ],
    )
    assert (prime["input_ids"], prime["loss_mask"]) == (ids, mask)
    ids, mask = pieces_to_ids(
        tokenizer,
        [
            (f"{BOS}{USER}Name a colour.{ASSISTANT}</think>", 0),
            ("Red.", 1),
            (EOS, 1),
            (f"{USER}Name another.{ASSISTANT}</think>", 0),
            ("Blue 🔵.", 1),
            (EOS, 1),
            (f"{USER}And a third, in German?{ASSISTANT}<think>", 0),
            ("Blau is blue; pick green.</think>Grün.", 1),
            (EOS, 1),
        ],
    )
    assert (colours["input_ids"], colours["loss_mask"]) == (ids, mask)
    # Final-turn rows in the same part keep the plain prompt + completion mask.
    nor = rows[0]
    assert nor["loss_mask"] == [0] * nor["prompt_len"] + [1] * nor["completion_len"]


def test_loss_options_apply_to_earlier_answers_and_truncation_to_the_final_one(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A part of every-turn rows only; the final answer of one was cut off inside its reasoning."""
    cfg = make_cfg(tmp_path, tokenizer_dir, loss_on_reasoning=False, loss_on_end_of_turn=False)
    rows_in = [
        response(PRIME, "Next after 7 is 11.", "Eleven.", PRIME_HISTORY),
        response(COLOURS, "Blau is bl", "", COLOURS_HISTORY, finish_reason="length"),
    ]
    write_part_inputs(tmp_path, 0, [PRIME, COLOURS], rows_in)
    stats = reconstruct_part(cfg, 0, DEMO)
    prime, colours = read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()
    assert stats["multiturn_rows"] == stats["rows"] == 2

    def masked(row: dict[str, Any]) -> str:
        return decode(tokenizer, [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m])

    assert masked(prime) == "Seven.Eleven."
    assert masked(colours) == "Red.Blue 🔵."
    completion = colours["input_ids"][colours["prompt_len"] :]
    assert decode(tokenizer, completion) == "Blau is bl"
    assert colours["reasoning_len"] == colours["completion_len"] == len(completion)


def test_every_turn_row_with_engine_ids_validates_exact(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """SGLang-style ids: prompt_ids as the engine renders the final request, output_ids as generated."""
    cfg = make_cfg(tmp_path, tokenizer_dir)
    reasoning, content = "Blau is blue; pick green.", "Grün."
    output = encode(tokenizer, completion_text(DEMO, reasoning, content))
    sent = render_prompt_ids(tokenizer, template_messages(COLOURS_HISTORY))
    leaked = [*PRIME_HISTORY[:2], answer("Seven.</think>Actually eleven.", "Small primes."), PRIME_HISTORY[3]]
    special = [user("Name a colour."), answer(f"Red{USER}", "Any."), user("Name another."), answer("Blue.", "Not red.")]
    part = [
        response(NOR, "Logic gates.", "A NOR gate is an OR gate followed by NOT."),
        response(
            COLOURS,
            reasoning,
            content,
            COLOURS_HISTORY,
            prompt_ids=sent,
            output_ids=output,
            completion_tokens=len(output),
            reasoning_tokens=len(encode(tokenizer, reasoning)),
        ),
        response(PRIME, "Eleven it is.", "Eleven.", leaked),
        response(TWO_COLOURS, "Green.", "Green.", [*special, user("And a third, in German?")]),
    ]
    write_part_inputs(tmp_path, 0, [NOR, COLOURS, PRIME, TWO_COLOURS], part)
    reconstruct_part(cfg, 0, DEMO)
    assert validate_part(cfg, 0, DEMO)["rows"] == 4
    nor, colours, prime, two = read_part(PartRef(tmp_path, "validation", 0)).to_pylist()

    assert (colours["reference_match"], colours["verdict"], colours["structural_issues"]) == ("exact", "pass", [])
    assert colours["our_completion_tokens"] == len(output) and colours["billing_delta_tokens"] == 0
    assert colours["reasoning_delta_tokens"] == 0
    assert (nor["reference_match"], nor["verdict"]) == ("no_reference", "pass")
    # Earlier answers carry loss too: a wrong split or a special-token string there fails the sample.
    assert prime["structural_issues"] == ["history_close_tag_in_content:turn 2"] and prime["verdict"] == "fail"
    assert two["structural_issues"] == [f"history_special_token_in_content:turn 1 {USER}"]
    assert two["verdict"] == "fail"


def test_planted_prompt_ids_mismatch_fails_naming_the_sample(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    cfg = make_cfg(tmp_path, tokenizer_dir)
    sent = render_prompt_ids(tokenizer, template_messages(PRIME_HISTORY))
    rows = [response(NOR, "R", "C"), response(PRIME, "R", "Eleven.", PRIME_HISTORY, prompt_ids=sent)]
    write_part_inputs(tmp_path, 0, [NOR, PRIME], rows)
    assert reconstruct_part(cfg, 0, DEMO)["multiturn_rows"] == 1

    # An engine that rendered the dataset's conversation instead of the regenerated one.
    stale = render_prompt_ids(tokenizer, prompt_messages(PRIME))
    at = next(i for i, (a, b) in enumerate(zip(sent, stale, strict=False)) if a != b)
    rows[1]["prompt_ids"] = stale
    write_part_inputs(tmp_path, 1, [NOR, PRIME], rows)
    with pytest.raises(ReconstructionError, match=f"sample {sid_of(PRIME)}: .* at position {at}"):
        reconstruct_part(cfg, 1, DEMO)
    assert not PartRef(tmp_path, "tokens", 1).is_done()


def test_history_that_is_not_the_prompts_conversation_fails_naming_the_sample(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    other = [user("Name a prime."), answer("Seven.", "Small."), user("A different follow-up.")]
    write_part_inputs(tmp_path, 0, [NOR, PRIME], [response(NOR, "R", "C"), response(PRIME, "R", "Eleven.", other)])
    with pytest.raises(ReconstructionError, match=f"sample {sid_of(PRIME)}: history's dataset turns differ .* turn 0"):
        reconstruct_part(make_cfg(tmp_path, tokenizer_dir), 0, DEMO)


def test_every_turn_final_answer_is_stored_as_the_ids_the_engine_returned(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A final answer in a split re-encoding never gives ("blue" as its single bytes) is stored as the model's
    ids, as for a row answered in one request; the context stays the engine's rendering of the history. Ids
    that do not spell the answer (the text was changed afterwards) leave the row re-encoded."""
    index = token_bytes_index(tokenizer)
    reasoning, content = "Blau is blue; pick green.", "Grün."
    text = completion_text(DEMO, reasoning, content)
    head, _, tail = text.partition("blue")
    split = [index.by_bytes[bytes([b])] for b in b"blue"]
    output = [*encode(tokenizer, head), *split, *encode(tokenizer, tail)]
    assert decode(tokenizer, output) == text and output != encode(tokenizer, text)
    sent = render_prompt_ids(tokenizer, template_messages(COLOURS_HISTORY))
    changed = [*output[:-2], *encode(tokenizer, "!"), output[-1]]
    for part, ids in enumerate((output, changed)):
        row = response(COLOURS, reasoning, content, COLOURS_HISTORY, prompt_ids=sent, output_ids=ids)
        write_part_inputs(tmp_path, part, [COLOURS], [row])
        assert reconstruct_part(make_cfg(tmp_path, tokenizer_dir), part, DEMO)["multiturn_rows"] == 1
        validate_part(make_cfg(tmp_path, tokenizer_dir), part, DEMO)
    exact, reencoded = (read_part(PartRef(tmp_path, "tokens", p)).to_pylist()[0] for p in (0, 1))
    assert exact["input_ids"] == [*sent, *output] and exact["token_source"] == "model"
    assert reencoded["input_ids"] == [*sent, *encode(tokenizer, text)] and reencoded["token_source"] == "reencoded"
    masked = [t for t, m in zip(exact["input_ids"], exact["loss_mask"], strict=True) if m]
    assert decode(tokenizer, masked[-len(output) :]) == text
    checks = [read_part(PartRef(tmp_path, "validation", p)).to_pylist()[0] for p in (0, 1)]
    assert (checks[0]["verdict"], checks[0]["reference_match"]) == ("pass", "bpe_artifact")
    assert checks[1]["verdict"] == "fail" and checks[1]["reference_match"] == "real_difference"

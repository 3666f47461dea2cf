"""Repairing re-encoded ids with the splits reference answers show (`reconstruct.repair_from`): rules are learned
only where the model mostly replaced the re-encoding, applying them never changes the text, and a run whose
endpoint gave no ids gets the model's split back."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from tasks.common.errors import ConfigError
from tasks.common.messages import Message
from tasks.common.shards import PartRef, read_part
from tasks.reconstruct.completion_format import PRESETS
from tasks.reconstruct.repair import RepairTable
from tasks.reconstruct.stage import reconstruct_part
from tasks.reconstruct.tokenizer_backend import backend_for
from tests.test_reconstruct import make_cfg, response_row, sid_of, write_inputs

DEMO = PRESETS["deepseek_v4_thinking"]
EOS = "<｜end▁of▁sentence｜>"
REASONING = "Recall where the pole is."


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def split(tokenizer: PreTrainedTokenizerBase, ids: list[int], word: str, parts: tuple[str, ...]) -> list[int]:
    """The model's way of writing `word` (one token when re-encoded): as `parts`, one token each."""
    whole = encode(tokenizer, word)
    pieces = [t for part in parts for t in encode(tokenizer, part)]
    assert len(whole) == 1 and len(pieces) == len(parts)
    return [t for token in ids for t in (pieces if token == whole[0] else [token])]


def split_north(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    return split(tokenizer, ids, " NORTH", (" ", "NOR", "TH"))


def test_rules_follow_what_the_model_mostly_did(tokenizer: PreTrainedTokenizerBase) -> None:
    backend = backend_for(tokenizer)
    texts = [f"Go NORTH at step {i}, then EAST." for i in range(4)]
    ours = [encode(tokenizer, t) for t in texts]
    model = [split_north(tokenizer, ids) for ids in ours[:3]] + [ours[3]]  # the 4th answer kept the merge
    model[0] = split(tokenizer, model[0], " EAST", (" E", "AST"))  # a one-off split: not a rule
    table = RepairTable.learn(backend, zip(ours, model, strict=True))
    north = tuple(encode(tokenizer, " NORTH"))
    assert table.rules == {north: tuple(split_north(tokenizer, list(north)))}
    assert table.replaced[north] == 3 and table.kept[north] == 1
    fresh = encode(tokenizer, "Turn NORTH now, then NORTH again.")
    fixed, applied = table.apply(backend, fresh)
    assert applied == 2 and fixed == split_north(tokenizer, fresh)
    assert tokenizer.decode(fixed) == tokenizer.decode(fresh)


def write_reference(tokenizer: PreTrainedTokenizerBase, reference_dir: Path, finish_reason: str = "stop") -> None:
    answers = [f"Walk NORTH for {i} miles." for i in range(4)]
    convs = [[Message(role="user", content=f"Where to, question {i}?")] for i in range(4)]
    rows = []
    for conv, answer in zip(convs, answers, strict=True):
        model_ids = split_north(tokenizer, encode(tokenizer, f"{REASONING}</think>{answer}{EOS}"))
        rows.append(response_row(sid_of(conv), REASONING, answer, output_ids=model_ids, finish_reason=finish_reason))
    write_inputs(reference_dir, 0, convs, rows)


def test_a_repair_that_moves_the_length_away_from_the_bill_is_refused(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The same answer three times, billed at the repaired length, at the re-encoded length (the model kept the
    merge there: an independent probe found a rule rewriting rows that were already exact), and not billed."""
    write_reference(tokenizer, tmp_path / "reference")
    answer = "Then NORTH again."
    reencoded = encode(tokenizer, f"{REASONING}</think>{answer}{EOS}")
    repaired = split_north(tokenizer, reencoded)
    assert len(repaired) == len(reencoded) + 2
    convs = [[Message(role="user", content=f"Other question {i}?")] for i in range(3)]
    bills = [len(repaired), len(reencoded), None]
    rows = [
        response_row(sid_of(c), REASONING, answer, completion_tokens=bill) for c, bill in zip(convs, bills, strict=True)
    ]
    write_inputs(tmp_path / "text", 0, convs, rows)
    stats = reconstruct_part(make_cfg(tmp_path / "text", tokenizer_dir, repair_from=tmp_path / "reference"), 0, DEMO)
    out = {r["sample_id"]: r for r in read_part(PartRef(tmp_path / "text", "tokens", 0)).to_pylist()}
    billed_repaired, billed_kept, unbilled = (out[sid_of(c)] for c in convs)
    assert [billed_repaired["token_source"], billed_kept["token_source"], unbilled["token_source"]] == [
        "repaired",
        "reencoded",
        "repaired",
    ]
    assert billed_kept["input_ids"][billed_kept["prompt_len"] :] == reencoded
    assert stats["repairs_refused_by_bill"] == 1 and stats["repaired_rows"] == 2


def test_answers_cut_by_max_tokens_teach_no_rule(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """A cut answer's last split depends on text the model had not written yet (a probe's `ĊĊ` -> `Ċ Ċ` rule came
    from two answers cut right after a paragraph break)."""
    write_reference(tokenizer, tmp_path / "reference", finish_reason="length")
    convs = [[Message(role="user", content="Other question?")]]
    write_inputs(tmp_path / "text", 0, convs, [response_row(sid_of(convs[0]), REASONING, "Then NORTH again.")])
    with pytest.raises(ConfigError, match="no finished response there carries the model's ids"):
        reconstruct_part(make_cfg(tmp_path / "text", tokenizer_dir, repair_from=tmp_path / "reference"), 0, DEMO)


def test_repair_from_a_reference_run(tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """The reference run's /generate ids teach the split; the text-only run's rows get it (token_source
    "repaired"), the rest stay re-encoded, and the rules are part of the tokens recipe."""
    reference_dir, text_dir = tmp_path / "reference", tmp_path / "text"
    write_reference(tokenizer, reference_dir)
    reconstruct_part(make_cfg(reference_dir, tokenizer_dir), 0, DEMO)

    text_convs = [[Message(role="user", content=f"Other question {i}?")] for i in range(2)]
    text_answers = ["Then NORTH again.", "No turns here."]
    write_inputs(
        text_dir,
        0,
        text_convs,
        [response_row(sid_of(c), REASONING, a) for c, a in zip(text_convs, text_answers, strict=True)],
    )
    stats = reconstruct_part(make_cfg(text_dir, tokenizer_dir, repair_from=reference_dir), 0, DEMO)
    out = {r["sample_id"]: r for r in read_part(PartRef(text_dir, "tokens", 0)).to_pylist()}
    first, second = (out[sid_of(c)] for c in text_convs)
    assert first["token_source"] == "repaired" and second["token_source"] == "reencoded"
    expected = split_north(tokenizer, encode(tokenizer, f"{REASONING}</think>{text_answers[0]}{EOS}"))
    assert first["input_ids"][first["prompt_len"] :] == expected
    assert stats["repaired_rows"] == 1 and stats["reencoded_rows"] == 1
    assert sum(first["loss_mask"]) == len(expected)
    plain = reconstruct_part(make_cfg(text_dir, tokenizer_dir), 0, DEMO)  # no repair: another recipe, rebuilt
    assert not plain["reused"] and plain["repaired_rows"] == 0


def test_the_bill_of_an_answer_cut_inside_a_character_counts_the_cut_word(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """An answer cut by max_tokens inside "ü" is stored up to its last whole word, but the provider billed every
    token the model emitted. Billed at the whole answer's re-encoded length (the model kept the merge), the
    repair is refused; compared with the kept prefix alone, the cut word's tokens made the repair look closer to
    the bill and it was applied."""
    write_reference(tokenizer, tmp_path / "reference")
    answer = "Then NORTH again. Z\ufffd"
    whole = encode(tokenizer, f"{REASONING}</think>{answer}")
    kept = encode(tokenizer, f"{REASONING}</think>Then NORTH again.")
    assert 0 < len(whole) - len(kept) <= len(split_north(tokenizer, kept)) - len(kept)
    convs = [[Message(role="user", content=f"Cut question {i}?")] for i in range(2)]
    bills = [len(whole), len(whole) + 2]
    rows = [
        response_row(sid_of(c), REASONING, answer, completion_tokens=bill, finish_reason="length")
        for c, bill in zip(convs, bills, strict=True)
    ]
    write_inputs(tmp_path / "text", 0, convs, rows)
    cfg = make_cfg(tmp_path / "text", tokenizer_dir, repair_from=tmp_path / "reference")
    stats = reconstruct_part(cfg, 0, DEMO)
    out = {r["sample_id"]: r for r in read_part(PartRef(tmp_path / "text", "tokens", 0)).to_pylist()}
    merge_kept, split_billed = (out[sid_of(c)] for c in convs)
    assert merge_kept["token_source"] == "reencoded"
    assert merge_kept["input_ids"][merge_kept["prompt_len"] :] == kept
    assert split_billed["token_source"] == "repaired"
    assert split_billed["input_ids"][split_billed["prompt_len"] :] == split_north(tokenizer, kept)
    assert stats["repairs_refused_by_bill"] == 1

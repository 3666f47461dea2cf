"""A chat template that prints today's date (gpt-oss's `Current date:`) is rendered at the time the request was
sent, not at reconstruct time: a rebuild on another day gave other prompt ids with the same token count, which no
check saw (tasks/reconstruct/template_clock.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from tasks.common.messages import Message
from tasks.common.shards import PartRef, read_marker, read_part
from tasks.generate.ledger import LedgerWriter
from tasks.reconstruct.completion_format import PRESETS
from tasks.reconstruct.stage import reconstruct_part
from tasks.reconstruct.template_clock import template_prints_date
from tasks.reconstruct.tokenizer_loading import load_tokenizer, render_prompt_ids
from tests.fixtures.families import shared_dir
from tests.test_reconstruct import make_cfg, response_row, sid_of, write_inputs

HARMONY = PRESETS["gpt_oss_harmony"]


def utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_a_dated_template_is_rendered_at_the_requests_send_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer_dir = shared_dir("gpt_oss")
    assert template_prints_date(tokenizer_dir)
    cfg = make_cfg(tmp_path, tokenizer_dir)
    tokenizer = load_tokenizer(cfg.tokenizer)
    convs = [[Message(role="user", content=f"Question {i}?")] for i in range(3)]
    sent_ids = render_prompt_ids(tokenizer, convs[2])  # what a /generate request carried, rendered some day

    clock = iter([utc("2026-01-13T10:00:00"), utc("2026-01-15T23:59:30")])
    monkeypatch.setattr("tasks.generate.ledger.time.time", lambda: next(clock))
    ledger = LedgerWriter(tmp_path, group_commit_s=0.0)
    for generation_id in ("gen-old", "gen-a"):  # two answered attempts: the stored row is the second's
        uid = ledger.sent(sid_of(convs[0]), "demo", 0, 0.01)
        ledger.ended(uid, "answered", 0.001, generation_id, None)
    ledger.close()
    monkeypatch.undo()

    rows = [
        response_row(sid_of(convs[0]), "R", "C", generation_id="gen-a"),
        response_row(sid_of(convs[1]), "R", "C"),  # no ledger record here: the responses part's time
        response_row(sid_of(convs[2]), "R", "C", prompt_ids=sent_ids),
    ]
    write_inputs(tmp_path, 0, convs, rows)
    reconstruct_part(cfg, 0, HARMONY)

    tokens = {r["sample_id"]: r for r in read_part(PartRef(tmp_path, "tokens", 0)).to_pylist()}

    def prompt(i: int) -> str:
        row = tokens[sid_of(convs[i])]
        return str(tokenizer.decode(row["input_ids"][: row["prompt_len"]], skip_special_tokens=False))

    assert "Current date: 2026-01-15\n" in prompt(0), prompt(0)
    finished = read_marker(PartRef(tmp_path, "responses", 0))["finished_at"]
    assert f"Current date: {datetime.fromtimestamp(finished, tz=UTC):%Y-%m-%d}\n" in prompt(1)
    row = tokens[sid_of(convs[2])]
    assert row["input_ids"][: row["prompt_len"]] == sent_ids


def test_a_host_that_never_ran_generate_pulls_the_send_times_first(tmp_path: Path) -> None:
    """Reconstruct on another host (the validate deployment, a rerun elsewhere) had no ledger and rendered the
    date of the responses part's finish time instead; the CPU stages now pull every host's ledger first."""
    from flows.pipeline import pull_send_times
    from tasks.common.artifact_store import RunStore
    from tasks.generate.ledger import SpendLedger
    from tasks.generate.store_sync import LogMirror

    store_url = f"file://{tmp_path / 'bucket'}"
    generating = RunStore(store_url, tmp_path / "a" / "run")
    writer = LedgerWriter(generating.local_run_dir, group_commit_s=0.0)
    uid = writer.sent("s1", "demo", 0, 0.01)
    writer.ended(uid, "answered", 0.001, "gen-1", None)
    writer.close()
    LogMirror(generating, every_s=60).push()

    other = RunStore(store_url, tmp_path / "b" / "run")
    cfg = make_cfg(other.local_run_dir, shared_dir("gpt_oss"))
    pull_send_times(cfg, other)
    assert SpendLedger.load(other.local_run_dir).attempts[uid].generation_id == "gen-1"

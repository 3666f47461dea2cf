"""The spend ledger's attempt states and their settlement from the key's account, on hand-written segments: what
every cost figure is summed from (docs/ledger-and-failures.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.generate.journal import AppendLog
from tasks.generate.ledger import LedgerWriter, SpendLedger, ledger_dir
from tasks.generate.settlement import account_settlements, pending_notice


def segment(run_dir: Path, name: str, records: list[dict[str, object]]) -> None:
    log = AppendLog(ledger_dir(run_dir) / f"ledger-{name}.log", group_commit_s=0.2)
    for rec in records:
        log.write_now(rec)
    log.close()


def sent(uid: str, worst: float, t: float | None = None, sample: str = "s", part: int = 0) -> dict[str, object]:
    rec: dict[str, object] = {"k": "s", "a": uid, "id": sample, "d": "ds", "p": part, "w": worst}
    if t is not None:
        rec["t"] = t
    return rec


def acct(at: str, usage: float, t: float, stable: bool = True) -> dict[str, object]:
    return {"k": "acct", "at": at, "usage": usage, "limit_remaining": None, "t": t, "host": "h", "stable": stable}


def test_each_attempt_is_in_one_state_and_the_totals_keep_billed_and_pending_apart(tmp_path: Path) -> None:
    writer = LedgerWriter(tmp_path, group_commit_s=0.2)
    answered = writer.sent("a", "ds", 0, 0.5)
    writer.ended(answered, "answered", 0.125, "gen-a", None)
    refused = writer.sent("b", "ds", 0, 0.5)
    writer.ended(refused, "unsent", 0.3, None, "connect")  # whatever the caller says: never sent is $0
    cut = writer.sent("c", "ds", 1, 0.5)
    writer.generation(cut, "gen-c")
    writer.ended(cut, "pending", None, None, "timeout")
    writer.sent("d", "ds", 1, 0.25)  # in flight at a kill: no outcome ever written
    settled = writer.sent("e", "ds", 1, 0.5)
    writer.ended(settled, "pending", None, "gen-e", "connection")
    writer.settled(settled, 0.0625, "generation")
    writer.close()

    ledger = SpendLedger.load(tmp_path)
    states = {a.sample_id: a.state for a in ledger.attempts.values()}
    assert states == {"a": "answered", "b": "unsent", "c": "pending", "d": "pending", "e": "settled"}
    assert ledger.attempts[cut].generation_id == "gen-c", "the id from the first chunk survives an outcome without it"
    assert ledger.pending_with_ids() == [(cut, "gen-c", 0.5)]
    assert ledger.totals().to_dict() == {
        "billed_usd": 0.1875,
        "pending_usd": 0.75,
        "counted_usd": 0.9375,
        "attempts": 5,
        "unsent_attempts": 1,
        "answered_attempts": 1,
        "pending_attempts": 2,
        "settled_attempts": 1,
        "settled_by": {"generation": 1},
    }
    assert ledger.totals_by_part()[1].pending_usd == 0.75
    assert ledger.totals_of_run(writer.token).counted_usd == pytest.approx(0.9375)


def test_segments_written_before_the_states_still_read(tmp_path: Path) -> None:
    """`b` without `o`: a null cost was an unknown outcome (pending), a number an answer; `r` without `src` came
    from the generation record. Records of an attempt may sort before its `s` (another host's clock)."""
    segment(
        tmp_path,
        "001",
        [
            sent("x:0", 0.5),
            {"k": "b", "a": "x:0", "c": 0.25, "g": "gen-0", "r": None},
            sent("x:1", 0.5),
            {"k": "b", "a": "x:1", "c": None, "g": None, "r": "timeout"},
            sent("x:2", 0.5),
            {"k": "b", "a": "x:2", "c": None, "g": "gen-2", "r": "truncated_stream"},
            {"k": "r", "a": "x:2", "c": 0.125},
        ],
    )
    segment(tmp_path, "000", [{"k": "r", "a": "y:0", "c": 0.0625, "src": "account"}])
    segment(tmp_path, "002", [sent("y:0", 0.5, t=5.0)])
    ledger = SpendLedger.load(tmp_path)
    assert [a.state for a in ledger.attempts.values()] == ["answered", "pending", "settled", "settled"]
    totals = ledger.totals()
    assert (totals.billed_usd, totals.pending_usd) == (0.4375, 0.5)
    assert dict(totals.settled_by) == {"generation": 1, "account": 1}


def test_account_windows_settle_pending_attempts_from_the_keys_usage(tmp_path: Path) -> None:
    """Window 1 (t 10-20): the key was charged 0.9, answers known 0.5, so the two pending attempts cost 0.4,
    apportioned by worst case. The unstable reading at 25 bounds nothing, so window 2 runs 20-40: charged 0.5,
    nothing known, over pending worst cases 0.5 and 1.5 (the unsent attempt costs nothing). After 40 nothing is
    bounded yet."""
    segment(
        tmp_path,
        "001",
        [
            acct("start", 1.0, 10.0),
            sent("r1:0", 0.5, t=11.0),
            {"k": "b", "a": "r1:0", "o": "answered", "c": 0.5, "g": "g0", "r": None},
            sent("r1:1", 0.2, t=12.0),
            sent("r1:2", 0.6, t=13.0),
        ],
    )
    segment(
        tmp_path,
        "002",
        [
            acct("start", 1.9, 20.0),
            sent("r2:0", 0.5, t=21.0),
            {"k": "b", "a": "r2:0", "o": "pending", "c": None, "g": None, "r": "connection"},
            acct("end", 2.0, 25.0, stable=False),
            sent("r2:1", 1.5, t=30.0),
            {"k": "b", "a": "r2:1", "o": "unsent", "c": 0.0, "g": None, "r": "connect"},
            sent("r2:2", 1.5, t=31.0),
            acct("start", 2.4, 40.0),
            sent("r3:0", 9.0, t=41.0),
        ],
    )
    ledger = SpendLedger.load(tmp_path)
    settled, problems = account_settlements(ledger)
    assert problems == []
    assert dict(settled) == pytest.approx({"r1:1": 0.1, "r1:2": 0.3, "r2:0": 0.125, "r2:2": 0.375})
    assert "r3:0" not in dict(settled) and "r2:1" not in dict(settled)


@pytest.mark.parametrize(("usage_after", "why"), [(0.7, "below what is known billed"), (5.0, "above the worst case")])
def test_a_window_the_key_cannot_explain_settles_nothing(tmp_path: Path, usage_after: float, why: str) -> None:
    segment(
        tmp_path,
        "001",
        [
            acct("start", 0.0, 1.0),
            sent("a:0", 1.0, t=2.0),
            {"k": "b", "a": "a:0", "o": "answered", "c": 1.0, "g": "g", "r": None},
            sent("a:1", 1.0, t=3.0),
            acct("end", usage_after, 4.0),
        ],
    )
    settled, problems = account_settlements(SpendLedger.load(tmp_path))
    assert settled == [], why
    assert len(problems) == 1 and "something else used the key" in problems[0]


def test_the_pending_notice_names_the_amount_and_what_settles_it() -> None:
    spend = {"pending_attempts": 3, "pending_usd": 0.015, "billed_usd": 0.25}
    shared = pending_notice(spend, "off")
    assert shared is not None and "pending: $0.0150 over 3 attempts" in shared and "$0.2500 billed" in shared
    assert "account_settlement: exclusive_key" in shared
    assert pending_notice({**spend, "pending_attempts": 0}, "off") is None


def window_with_a_cut_stream(reason: str) -> list[dict[str, object]]:
    """One account window: an answer billed $1, a cut request with a generation id (`reason`), and one cut
    before its id arrived."""
    return [
        acct("start", 0.0, 1.0),
        sent("a:0", 1.0, t=2.0),
        {"k": "b", "a": "a:0", "o": "answered", "c": 1.0, "g": "g0", "r": None},
        sent("a:1", 1.0, t=3.0),
        {"k": "b", "a": "a:1", "o": "pending", "c": None, "g": "g1", "r": reason},
        sent("a:2", 1.0, t=3.5),
        {"k": "b", "a": "a:2", "o": "pending", "c": None, "g": None, "r": "connection"},
        acct("end", 1.0, 4.0),
    ]


def test_a_window_with_attempts_awaiting_their_generation_records_is_left_to_those_records(tmp_path: Path) -> None:
    """A provider that cannot cancel a cut stream bills it when the model finishes, after the key's usage looked
    stable: the window read $0 for 7 cut streams billed $0.81 (a billing probe), and the cap was crossed. With
    generation records looked up, such a window waits for them; without, the key's account is all there is."""
    segment(
        tmp_path,
        "001",
        window_with_a_cut_stream("stream_idle"),
    )
    ledger = SpendLedger.load(tmp_path)
    settled, problems = account_settlements(ledger, records_settle_ids=True)
    assert settled == [] and len(problems) == 1 and "1 of 2 pending attempts" in problems[0]
    assert dict(account_settlements(ledger)[0]) == pytest.approx({"a:1": 0.0, "a:2": 0.0})


@pytest.mark.parametrize(
    ("reason", "age_s", "ended"),
    [
        ("error_body", 31.0, True),
        ("stream_error", 31.0, True),
        ("http_503", 31.0, True),
        ("context_length", 31.0, True),
        ("error_body", 5.0, False),
        ("http_524", 31.0, False),
        ("timeout", 31.0, False),
        ("stream_idle", 31.0, False),
    ],
)
def test_an_error_the_provider_ended_long_ago_is_settled_by_its_record_or_its_absence(
    reason: str, age_s: float, ended: bool
) -> None:
    """An HTTP 200 error body naming a generation the provider never recorded stayed pending at worst case for
    good (a billing re-verifier): like an error status, once old enough a missing or $0 record is its bill. A
    timeout the server reported, or a cut stream, may still be generating and be billed later."""
    from tasks.generate.ledger import Attempt
    from tasks.generate.settlement import ended_long_ago

    attempt = Attempt("s", "d", 0, 1.0, sent_at=1000.0, outcome="pending", generation_id="g", reason=reason)
    assert ended_long_ago(attempt, 1000.0 + age_s) is ended


def test_a_window_held_for_a_cut_stream_settles_once_a_reading_follows_the_end_of_its_generation(
    tmp_path: Path,
) -> None:
    """1,499 requests a killed endpoint never billed stayed pending at worst case forever with exclusive_key: a
    window holding one with a generation id waited for a record the dead server never wrote. Once a stable
    reading follows the end of its generation (sent + request_timeout_s + ABSENT_RECORD_GRACE_S), the window
    widened to that reading settles it, and a bill written when the model finished (after the window's own
    closing reading) is in that wider window: 0.5 here."""
    segment(
        tmp_path,
        "001",
        [
            *window_with_a_cut_stream("connection"),
            acct("start", 1.5, 50.0),
            sent("b:0", 1.0, t=51.0),
            {"k": "b", "a": "b:0", "o": "answered", "c": 0.25, "g": "g2", "r": None},
            acct("end", 1.75, 60.0),
        ],
    )
    ledger = SpendLedger.load(tmp_path)
    waiting, problems = account_settlements(ledger, records_settle_ids=True, request_timeout_s=100.0)
    assert waiting == [] and "1 of 2 pending attempts" in problems[0] and "request_timeout_s" in problems[0]
    segment(tmp_path, "002", [acct("start", 1.75, 200.0)])
    ledger = SpendLedger.load(tmp_path)
    settled, problems = account_settlements(ledger, records_settle_ids=True, request_timeout_s=100.0)
    assert problems == [] and dict(settled) == pytest.approx({"a:1": 0.25, "a:2": 0.25})


def test_a_lower_timeout_on_a_rerun_does_not_end_a_generation_sent_under_a_higher_one(tmp_path: Path) -> None:
    """A cut request's generation counts as over request_timeout_s + 30 s after it was sent, and then settles at
    $0 when no record came. The timeout was read from the config of the run doing the settling: a rerun with
    900 s lowered to 60 s declared generations over that could still run, and a bill written later was lost. Each
    attempt keeps the timeout it was sent under; the longer of the two applies."""
    import time

    from tasks.generate.settlement import generation_over

    writer = LedgerWriter(tmp_path, group_commit_s=0.0)
    uid = writer.sent("s1", "demo", 0, 0.01, timeout_s=900.0)
    writer.ended(uid, "pending", None, "gen-1", "connection")
    writer.close()
    attempt = SpendLedger.load(tmp_path).attempts[uid]
    assert attempt.timeout_s == 900.0
    now = time.time() + 120.0
    assert not generation_over(attempt, now, timeout_s=60.0), "the rerun's lower timeout ended it"
    assert generation_over(attempt, now + 900.0, timeout_s=60.0)

"""Pending spend settled to the provider's bill: requests reset after they were sent, with a shared key and with
an exclusive one, and what a killed run left when its rerun has nothing to send. The kill loops themselves
(done-when 2 of issue 19) are test_generate_money.py's ten kills, scaled down, and test_outage_money.py's at
2,000 in flight (make test-long)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from endpoint_sim.responder import FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.config import PipelineConfig
from tasks.common.shards import PartRef
from tasks.generate import settlement
from tasks.generate.engine import generate_parts
from tasks.generate.ledger import LedgerWriter, SpendLedger
from tests.conftest import run_main
from tests.test_generate_failures import MARKERS, make_cfg, question, write_prompts
from tests.test_generate_money import write_config, write_dataset
from tests.test_spend_ledger import acct, segment, sent

IN_FLIGHT = 16
CAP_USD = 2.0


def settle_cfg(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, data: Path, **endpoint: Any) -> Path:
    return write_config(
        tmp_path,
        sim,
        tokenizer_dir,
        data,
        max_in_flight=IN_FLIGHT,
        max_cost_usd=CAP_USD,
        **{"account_settle_stable_s": 0.2, "account_settle_wait_s": 30.0, **endpoint},
    )


def account_cfg(
    run_dir: Path, sim: SimulatorServer, tokenizer_dir: Path, account_settlement: str = "exclusive_key", **endpoint: Any
) -> PipelineConfig:
    """An in-process `generate` config for a rerun that settles a killed run's ledger against `sim`."""
    return make_cfg(
        run_dir,
        sim.base_url,
        tokenizer_dir,
        "chat",
        account_settlement=account_settlement,
        account_settle_stable_s=0.1,
        **endpoint,
    )


def test_with_a_shared_key_pending_spend_stays_at_worst_case_and_is_printed(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Requests reset after they were sent (the provider may have billed them; they carry no id): pending at
    worst case, never shown as spent, counted against the cap, and printed with what would settle them. With
    `account_settlement: exclusive_key` a run whose requests reset settles them from the key's usage."""
    sim_cfg = SimConfig(seed=4, failures=(FailureRule(kind="reset", rate=0.5, attempts=1),))
    shared_dir, exclusive_dir = tmp_path / "shared", tmp_path / "exclusive"
    for where in (shared_dir, exclusive_dir):
        where.mkdir()
        write_dataset(where / "prompts.jsonl", 16, where.name)
    with SimulatorServer(tokenizer_dir, sim_cfg) as sim:
        config = settle_cfg(shared_dir, sim, tokenizer_dir, shared_dir / "prompts.jsonl", max_attempts=3)
        shared = run_main(capsys, "generate", str(config), "--no-progress")
        shared_bill = sim.billing()["total_usd"]
        config = settle_cfg(
            exclusive_dir, sim, tokenizer_dir, exclusive_dir / "prompts.jsonl", account_settlement="exclusive_key"
        )
        exclusive = run_main(capsys, "generate", str(config), "--no-progress")
        exclusive_bill = sim.billing()["total_usd"] - shared_bill
    assert shared.returncode == 0, shared.stderr
    totals = SpendLedger.load(shared_dir / "run").totals()
    assert totals.pending_attempts > 0 and totals.billed_usd == pytest.approx(shared_bill)
    assert totals.counted_usd <= CAP_USD
    assert f"pending: ${totals.pending_usd:.4f} over {totals.pending_attempts} attempts" in shared.stderr
    assert "account_settlement: exclusive_key" in shared.stderr

    assert exclusive.returncode == 0, exclusive.stderr
    totals = SpendLedger.load(exclusive_dir / "run").totals()
    assert totals.pending_attempts == 0 and totals.settled_by["account"] > 0
    assert totals.counted_usd == pytest.approx(exclusive_bill, abs=1e-9), "a reset request is billed nothing here"
    assert "pending:" not in exclusive.stderr


def test_a_rerun_with_nothing_left_to_send_settles_what_a_killed_run_left_pending(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """A killed run's ledger: its opening account reading, then three attempts it never saw end. One has a
    generation id (settled from that record, exactly), two have none (settled from the key's usage since the
    reading). The rerun has no sample to send, and still settles them before it returns."""
    with SimulatorServer(tokenizer_dir, SimConfig(seed=8)) as sim:
        killed = LedgerWriter(tmp_path, group_commit_s=0.2)
        killed.account("start", 0.0, None, stable=True)
        with_id, cut, queued = (killed.sent(f"s{i}", "ds", 0, 0.01 * (i + 1)) for i in range(3))
        killed.close()
        bills = []
        for prompt in ("the answer the kill cut", "a request cut before its id arrived"):
            body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
            bills.append(httpx.post(f"{sim.base_url}/v1/chat/completions", json=body, timeout=30).json())
        killed = LedgerWriter(tmp_path, group_commit_s=0.2)  # the id had reached the ledger before the kill
        killed.generation(with_id, bills[0]["id"])
        killed.close()
        cfg = account_cfg(tmp_path, sim, tokenizer_dir)
        summary = generate_parts(cfg, [], MARKERS).total()
        provider = sim.billing()["total_usd"]
    ledger = SpendLedger.load(tmp_path)
    assert {uid: a.settled_by for uid, a in ledger.attempts.items()} == {
        with_id: "generation",
        cut: "account",
        queued: "account",
    }
    assert ledger.attempts[with_id].billed_usd == pytest.approx(bills[0]["usage"]["cost"], abs=1e-12)
    # The two without an id share what the key was charged besides: by worst case, 0.02 : 0.03.
    rest = bills[1]["usage"]["cost"]
    assert ledger.attempts[cut].billed_usd == pytest.approx(rest * 0.4)
    assert ledger.attempts[queued].billed_usd == pytest.approx(rest * 0.6)
    totals = ledger.totals()
    assert totals.pending_attempts == 0 and totals.counted_usd == pytest.approx(provider, abs=1e-12)
    assert summary["settlement"]["by_source"]["account"]["attempts"] == 2 and summary["requests_sent"] == 0


@pytest.mark.slow  # waits out the account wait: make test-long
def test_a_key_whose_usage_is_behind_the_ledger_says_why_the_run_waits(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key whose usage lags what the run directory's answers are known billed (OpenRouter's usage catches up
    late) held generate silent for `account_settle_wait_s` (120 s by default) and its reason reached only
    run_summary.json on the worker (a UI probe). The wait and its outcome are run events: a log line each."""
    data = tmp_path / "prompts.jsonl"
    write_dataset(data, 8, "behind")
    with SimulatorServer(tokenizer_dir, SimConfig(seed=4, account_usage_lag_s=600.0)) as sim:
        config = settle_cfg(tmp_path, sim, tokenizer_dir, data, account_settlement="exclusive_key")
        first = run_main(capsys, "generate", str(config), "--no-progress")
        write_dataset(data, 12, "behind")
        config = settle_cfg(
            tmp_path, sim, tokenizer_dir, data, account_settlement="exclusive_key", account_settle_wait_s=1.0
        )
        second = run_main(capsys, "generate", str(config), "--no-progress")
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    assert "key's account at" in second.stderr and "waiting up to 1 s (endpoint.account_settle_wait_s)" in second.stderr
    assert "did not settle within endpoint.account_settle_wait_s=1 s (behind the answers known billed)" in second.stderr
    assert "starts a new baseline" not in second.stderr


def test_a_rotated_key_starts_a_new_account_baseline_instead_of_waiting_for_the_old_keys_total(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory whose API key was rotated between runs: the new key's usage never reaches the old key's
    total plus everything billed since, so every later run waited `account_settle_wait_s` (120 s by default)
    before sending anything, and the key's account settled nothing again (126 s per run where 11 s do now).
    Each reading now records which key took it; a reading of another key is a new baseline, said once, and the
    runs after it read the new key as they read the old one."""
    data = tmp_path / "prompts.jsonl"
    write_dataset(data, 8, "rotated")
    monkeypatch.setenv("EAGLE3_ROTATED_KEY", "sk-or-v1-old")
    with SimulatorServer(tokenizer_dir, SimConfig(seed=4, required_api_key="sk-or-v1-old")) as old:
        config = settle_cfg(
            tmp_path, old, tokenizer_dir, data, account_settlement="exclusive_key", api_key_env="EAGLE3_ROTATED_KEY"
        )
        first = run_main(capsys, "generate", str(config), "--no-progress")
        old_bill = old.billing()["total_usd"]
    monkeypatch.setenv("EAGLE3_ROTATED_KEY", "sk-or-v1-new")
    runs = []
    with SimulatorServer(tokenizer_dir, SimConfig(seed=5, required_api_key="sk-or-v1-new")) as new:
        for count in (12, 16):
            write_dataset(data, count, "rotated")
            config = settle_cfg(
                tmp_path, new, tokenizer_dir, data, account_settlement="exclusive_key", api_key_env="EAGLE3_ROTATED_KEY"
            )
            runs.append(run_main(capsys, "generate", str(config), "--no-progress"))
        new_bill = new.billing()["total_usd"]
    assert first.returncode == 0, first.stderr
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert "waiting up to" not in run.stderr and "did not settle" not in run.stderr, run.stderr
    assert "the key's account is not the one read before" in runs[0].stderr
    assert "starts a new baseline" in runs[0].stderr
    assert "not the one read before" not in runs[1].stderr, "the new key read twice is one account"
    ledger = SpendLedger.load(tmp_path / "run")
    readings = sorted(ledger.accounts, key=lambda s: s.t)
    assert all(r.stable for r in readings)
    keys = [r.key for r in readings]
    assert keys[0] == settlement.key_fingerprint("sk-or-v1-old") and keys[-1] == settlement.key_fingerprint(
        "sk-or-v1-new"
    )
    assert len(set(keys)) == 2 and new_bill > 0
    totals = ledger.totals()
    assert totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(old_bill + new_bill, abs=1e-9)
    for where in (tmp_path / "run").rglob("*"):
        if where.is_file():
            assert b"sk-or-v1-" not in where.read_bytes(), where


def test_an_account_window_across_two_keys_settles_nothing(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A killed run left a request pending after its key's last reading; the rerun reads another key (rotated),
    whose usage from its earlier use happens to exceed the old reading by less than that request's worst case.
    Settled from the difference, the request was booked at what the new key had spent elsewhere. Across two keys
    nothing is settled: the request stays at worst case, and the report says why."""
    long_ago = time.time() - 200.0
    old_key = settlement.key_fingerprint("sk-or-v1-old")
    with SimulatorServer(tokenizer_dir, SimConfig(seed=8, required_api_key="sk-or-v1-new")) as sim:
        body = {"model": "m", "messages": [{"role": "user", "content": "the new key's use elsewhere"}]}
        headers = {"Authorization": "Bearer sk-or-v1-new"}
        elsewhere = httpx.post(f"{sim.base_url}/v1/chat/completions", json=body, headers=headers, timeout=30).json()
        segment(
            tmp_path,
            "001",
            [
                {**acct("start", 0.0, long_ago - 1.0), "key": old_key},
                sent("cut", 0.05, t=long_ago),
            ],
        )
        cfg = account_cfg(tmp_path, sim, tokenizer_dir, api_key="sk-or-v1-new", settle_pending=False)
        summary = generate_parts(cfg, [], MARKERS).total()
    assert 0 < elsewhere["usage"]["cost"] < 0.05, "the difference must fit the pending worst case to be tempting"
    ledger = SpendLedger.load(tmp_path)
    assert ledger.attempts["cut"].state == "pending"
    assert any("two different keys" in p for p in summary["settlement"]["problems"]), summary["settlement"]


def test_readings_without_a_key_whose_usage_went_down_bound_no_window(tmp_path: Path) -> None:
    """Segments written before readings named their key: a usage that went down is another key's (no key's usage
    ever does), so the window between them settles nothing; one that went up still settles as before."""
    segment(
        tmp_path,
        "001",
        [
            acct("start", 1.0, 100.0),
            sent("down", 0.05, t=101.0),
            acct("end", 0.25, 102.0),
            sent("up", 0.05, t=103.0),
            acct("end", 0.27, 104.0),
        ],
    )
    settled, problems = settlement.account_settlements(SpendLedger.load(tmp_path))
    assert settled == [("up", pytest.approx(0.02))]
    assert len(problems) == 1 and "1 pending attempt sent between account readings of two different keys" in problems[0]


@pytest.mark.parametrize("account_settlement", ["exclusive_key", "off"])
def test_requests_a_dead_endpoint_cut_are_settled_at_zero_once_their_generation_is_over(
    tmp_path: Path, tokenizer_dir: Path, account_settlement: str
) -> None:
    """An endpoint killed with 1,500 requests in flight billed none of them, yet they stayed pending at worst case
    forever ($7.75 counted against a $0.68 bill) and every later run stopped at its cap: the 606 with a generation
    id waited for records the dead server never wrote, and held the key's account window back. Long enough after
    they were sent (request_timeout_s + 30 s), an endpoint known to keep records (a paid answer's record is read
    back) with no record of them did not bill them (`no_record`, $0); with an exclusive key, the account then
    settles those without an id too."""
    long_ago = time.time() - 200.0
    with SimulatorServer(tokenizer_dir, SimConfig(seed=8)) as sim:
        body = {"model": "m", "messages": [{"role": "user", "content": "the answer before the kill"}]}
        paid = httpx.post(f"{sim.base_url}/v1/chat/completions", json=body, timeout=30).json()
        segment(
            tmp_path,
            "001",
            [
                acct("start", 0.0, long_ago - 1.0),
                sent("paid", 0.05, t=long_ago),
                {"k": "b", "a": "paid", "o": "answered", "c": paid["usage"]["cost"], "g": paid["id"], "r": None},
                sent("cut", 0.05, t=long_ago + 1.0),
                {"k": "g", "a": "cut", "g": "gen-the-dead-server-never-wrote"},
                sent("queued", 0.05, t=long_ago + 1.0),
            ],
        )
        cfg = account_cfg(tmp_path, sim, tokenizer_dir, account_settlement, request_timeout_s=60.0)
        generate_parts(cfg, [], MARKERS)
        provider = sim.billing()["total_usd"]
    ledger = SpendLedger.load(tmp_path)
    assert ledger.attempts["cut"].settled_by == "no_record" and ledger.attempts["cut"].billed_usd == 0.0
    totals = ledger.totals()
    if account_settlement == "exclusive_key":
        assert ledger.attempts["queued"].settled_by == "account"
        assert totals.pending_attempts == 0 and totals.counted_usd == pytest.approx(provider, abs=1e-12)
    else:  # without an id and without the key's account, nothing says what it cost
        assert ledger.attempts["queued"].state == "pending" and totals.billed_usd == pytest.approx(provider)


@pytest.fixture()
def quick_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record that never comes is waited for 8.5 s per run at the production schedule; what these tests check
    does not depend on how long."""
    monkeypatch.setattr(settlement, "LOOKUP_BEFORE_RUN_S", (0.05,))
    monkeypatch.setattr(settlement, "LOOKUP_AFTER_RUN_S", (0.05, 0.1))


def test_a_cut_request_is_not_settled_at_zero_where_records_are_not_known_to_be_kept(
    tmp_path: Path, tokenizer_dir: Path, quick_lookups: None
) -> None:
    """An endpoint that keeps no generation records 404s every id: a missing record proves nothing there, so
    without a paid answer's record read back a cut request stays pending, whatever its age."""
    long_ago = time.time() - 200.0
    segment(tmp_path, "001", [sent("cut", 0.05, t=long_ago), {"k": "g", "a": "cut", "g": "gen-unknown"}])
    with SimulatorServer(tokenizer_dir, SimConfig(seed=8)) as sim:
        generate_parts(make_cfg(tmp_path, sim.base_url, tokenizer_dir, "chat", request_timeout_s=60.0), [], MARKERS)
    assert SpendLedger.load(tmp_path).attempts["cut"].state == "pending"


def test_a_cut_request_is_settled_at_zero_by_the_run_whose_answers_prove_records_kept(
    tmp_path: Path, tokenizer_dir: Path, quick_lookups: None
) -> None:
    """A killed run left only a cut request (an id, no paid answer): the rerun's opening pass has no evidence that
    the endpoint keeps records. Its answers are that evidence; the closing pass read the first pass's "no" back
    and left the cut request pending at worst case for another run."""
    segment(tmp_path, "001", [sent("cut", 0.05, t=time.time() - 200.0), {"k": "g", "a": "cut", "g": "gen-never"}])
    write_prompts(tmp_path, [question("proof", i) for i in range(2)])
    with SimulatorServer(tokenizer_dir, SimConfig(seed=8)) as sim:
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "chat", request_timeout_s=60.0)
        generate_parts(cfg, [PartRef(tmp_path, "prompts", 0)], MARKERS)
        provider = sim.billing()["total_usd"]
    ledger = SpendLedger.load(tmp_path)
    assert ledger.attempts["cut"].settled_by == "no_record" and ledger.attempts["cut"].billed_usd == 0.0
    totals = ledger.totals()
    assert totals.pending_attempts == 0 and totals.counted_usd == pytest.approx(provider, abs=1e-12)


def test_an_account_window_still_waiting_is_reported_once(tmp_path: Path, tokenizer_dir: Path) -> None:
    """The opening and the closing account pass each judged the window holding a cut request whose generation is
    not over yet, and the run's settlement problems carried the same line twice."""
    now = time.time()
    segment(
        tmp_path,
        "001",
        [
            acct("start", 0.0, now - 2.0),
            sent("cut", 0.05, t=now - 1.0),
            {"k": "g", "a": "cut", "g": "gen-still-generating"},
        ],
    )
    with SimulatorServer(tokenizer_dir, SimConfig(seed=9)) as sim:
        cfg = account_cfg(tmp_path, sim, tokenizer_dir)
        summary = generate_parts(cfg, [], MARKERS)
    problems = summary.settlement["problems"]
    waiting = [p for p in problems if "whose record is not in yet" in p]
    assert len(waiting) == 1, problems
    assert SpendLedger.load(tmp_path).attempts["cut"].state == "pending"

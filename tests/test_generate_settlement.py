"""Pending spend settled to the provider's bill: what a request's transport failure books, and `kill -9`s of
`generate` with the window full, settled from the generation records (streaming) and from the key's account
(done-when 2 of issue 19, scaled down; the 2,000-in-flight version is in test_outage_money.py, make test-long)."""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from endpoint_sim.responder import FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.shards import done_parts, read_part
from tasks.generate.ledger import SpendLedger
from tests.cli_zygote import CliZygote, ForkedCli
from tests.conftest import REPO, run_main
from tests.test_generate_money import billed, durable_rows, write_config, write_dataset

IN_FLIGHT = 64
PROMPTS = 240  # the kills bill ~100 answers and cut ~130 requests; the final run sends the rest
CAP_USD = 2.0
SIM = SimConfig(seed=23, latency_lognormal=(math.log(0.4), 0.3), reasoning_words=(5, 40), content_words=(5, 40))


def settle_cfg(tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, data: Path, **endpoint: Any) -> Path:
    return write_config(
        tmp_path,
        sim,
        tokenizer_dir,
        data,
        max_in_flight=IN_FLIGHT,
        max_cost_usd=CAP_USD,
        account_settle_stable_s=0.2,
        account_settle_wait_s=30.0,
        **endpoint,
    )


def kill_in_full_flight(sim: SimulatorServer, forked: ForkedCli, log: Path, min_answers: int) -> float:
    """SIGKILL once the window is at least 3/4 full and `min_answers` more were billed: mid-send, not at the end."""
    before = len(billed(sim))
    deadline = time.monotonic() + 180
    while True:
        stats = sim.stats(with_keys=False)
        if stats["in_flight"] >= IN_FLIGHT * 3 // 4 and len(billed(sim)) >= before + min_answers:
            break
        assert forked.poll() is None, f"generate exited before it was killed:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the window never filled:\n{log.read_text()}"
        time.sleep(0.005)
    return forked.kill_9()


def test_kill_9s_in_full_flight_settle_to_the_bill(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed streaming, then not streaming, each with the window full: the cut requests are billed by the
    provider for what they generated. The next run settles them before it sends anything: by generation id
    (streams: the id came with the headers) and, for what has no id, from the key's usage between the two runs'
    opening readings. No durable answer is bought again, the cap is never crossed, and the final figure is the
    bill within 2% (main's client: every request in flight at a kill stayed at its worst case)."""
    data = tmp_path / "prompts.jsonl"
    write_dataset(data, PROMPTS, "settle")
    log = tmp_path / "generate.log"
    run_dir = tmp_path / "run"
    with SimulatorServer(tokenizer_dir, SIM, billing_file=tmp_path / "bill.jsonl") as sim:
        config = settle_cfg(tmp_path, sim, tokenizer_dir, data, account_settlement="exclusive_key")
        kills: list[tuple[dict[str, dict[str, Any]], Counter[str]]] = []
        with CliZygote(REPO) as zygote:
            for stream in ("true", "false"):
                argv = ["generate", str(config), "--no-progress", "--set", f"endpoint.stream={stream}"]
                forked = zygote.start(argv, log)
                kill_in_full_flight(sim, forked, log, min_answers=20)
                time.sleep(0.3)  # the provider bills the requests the dead client's sockets were carrying
                kills.append((durable_rows(run_dir), Counter(sim.stats()["by_key"])))
                assert SpendLedger.load(run_dir).totals().counted_usd <= CAP_USD, "the ledger crossed the cap"
                assert sim.billing()["total_usd"] <= CAP_USD, "the provider billed past the cap"
        done = run_main(capsys, "generate", str(config), "--no-progress")
        end = Counter(sim.stats()["by_key"])
        provider = sim.billing()["total_usd"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [row for ref in done_parts(run_dir, "responses") for row in read_part(ref).to_pylist()]
    assert len(rows) == PROMPTS and len({r["sample_id"] for r in rows}) == PROMPTS
    assert {r["status"] for r in rows} == {"done"}
    for n, (durable, by_key) in enumerate(kills):
        for sid, row in durable.items():
            if row["status"] == "done":
                key = row["generation_id"].split("-", 2)[2]
                assert end[key] == by_key[key], f"kill {n + 1}: the durable answer of {sid} was bought again"
    totals = SpendLedger.load(run_dir).totals()
    print(f"recorded ${totals.counted_usd:.5f} vs billed ${provider:.5f}; settled {dict(totals.settled_by)}")
    assert totals.pending_attempts == 0 and set(totals.settled_by) == {"generation", "account"}
    assert totals.counted_usd == pytest.approx(provider, rel=0.02)
    assert provider <= CAP_USD and totals.counted_usd <= CAP_USD
    assert "pending:" not in done.stderr


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

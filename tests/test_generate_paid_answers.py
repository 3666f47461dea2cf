"""Answers the provider billed are counted at what it billed, and a whole answer is never bought twice.

Each case is a way real providers end an answer that an earlier client got wrong: an OpenRouter 200 whose body is
an error (the model had started, so the generation may be billed), a stream reset after its finish and usage
chunks but before `[DONE]` (the answer is whole and paid), and answers without `usage.cost` (the price table is an
estimate; the generation record is the bill).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from endpoint_sim.responder import FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.config import SamplingConfig
from tasks.generate.ledger import SpendLedger
from tasks.generate.progress import format_usd
from tasks.reconstruct.tokenizer_loading import load_tokenizer
from tests.test_generate_failures import (
    PRICE_COMPLETION,
    PRICE_PROMPT,
    committed_chunks,
    make_cfg,
    question,
    responses,
    run,
    write_prompts,
)

PROMPTS = 4


def _run(tmp_path: Path, tokenizer_dir: Path, sim_cfg: SimConfig, mode: str, **endpoint: object) -> tuple[dict, float]:
    write_prompts(tmp_path, [question(f"paid-{mode}", i) for i in range(PROMPTS)])
    with SimulatorServer(tokenizer_dir, sim_cfg) as sim:
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, SamplingConfig(max_tokens=512), **endpoint)
        summary = run(cfg, None).total()  # type: ignore[arg-type]
        provider = float(sim.billing()["total_usd"])
    return summary, provider


@pytest.mark.parametrize("mode", ["chat", "stream"])
def test_an_error_after_generation_began_is_counted_at_its_bill(mode: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    """OpenRouter answers HTTP 200 with an error body (or an error chunk) once the model has started: half an
    answer was billed. It is pending until its generation record settles it, never free."""
    sim_cfg = SimConfig(seed=5, failures=(FailureRule(kind="late_error_body", rate=1.0, attempts=1),))
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, mode)
    assert summary["done"] == PROMPTS
    assert summary["retries_by_reason"] == {("error_body" if mode == "chat" else "stream_error"): PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0 and dict(totals.settled_by) == {"generation": PROMPTS}
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


def test_a_stream_reset_after_its_usage_chunk_keeps_the_answer(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Finish and usage arrived, then the connection reset before `[DONE]`: the answer is whole and billed once;
    sending it again would buy it twice."""
    sim_cfg = SimConfig(seed=6, failures=(FailureRule(kind="reset_before_done", rate=1.0, attempts=1),))
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "stream")
    rows = responses(tmp_path).values()
    assert summary["done"] == PROMPTS and not summary["retries_by_reason"]
    assert all(r["attempts"] == 1 and r["finish_reason"] == "stop" and r["content"] for r in rows)
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


@pytest.mark.parametrize("mode", ["chat", "stream"])
def test_an_answer_without_usage_cost_is_counted_at_its_generation_record(
    mode: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """No usage.cost in the answer: the configured price table (here not the provider's prices) is only an
    estimate. With `reconcile_cost` the ledger records what the generation record says was billed."""
    sim_cfg = SimConfig(seed=7, report_cost=False)
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, mode, reconcile_cost=True)
    assert summary["done"] == PROMPTS
    rows = responses(tmp_path).values()
    assert sum(r["billed_cost_usd"] for r in rows) == pytest.approx(provider, abs=1e-12)
    assert sum(r["cost_usd"] for r in rows) != pytest.approx(provider), "the price table should not be the bill"
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


@pytest.mark.parametrize("mode", ["chat", "stream"])
def test_an_answer_without_usage_cost_is_recorded_at_its_bill_without_reconcile_cost(
    mode: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Without `reconcile_cost` (the default) such answers were booked as billed at the configured prices: a
    provider billing twice those prices was recorded at half its bill (a billing probe). Where the endpoint keeps
    generation records, the record is the bill."""
    sim_cfg = SimConfig(seed=7, report_cost=False, price_prompt_usd_per_mtok=2.0, price_completion_usd_per_mtok=6.0)
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, mode)
    assert summary["done"] == PROMPTS
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)
    assert sum(r["cost_usd"] for r in responses(tmp_path).values()) == pytest.approx(provider / 2, rel=0.02)


@pytest.mark.parametrize("mode", ["chat", "stream"])
@pytest.mark.parametrize("kind", ["finish_error", "empty"])
def test_a_retried_answer_without_usage_cost_is_counted_at_its_generation_record(
    kind: str, mode: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """An answer that parsed but is retried (finish_reason "error" with half an answer, an empty answer) is paid
    for as a kept one is. Without usage.cost it was booked at the configured prices, which here are half the
    provider's: the one place the ledger did not follow the generation record."""
    failure = FailureRule(kind=kind, rate=1.0, attempts=1)
    sim_cfg = SimConfig(
        seed=8, report_cost=False, price_prompt_usd_per_mtok=2.0, price_completion_usd_per_mtok=6.0, failures=(failure,)
    )
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, mode)
    reason = {"finish_error": "finish_error", "empty": "empty_response"}[kind]
    assert summary["done"] == PROMPTS and summary["retries_by_reason"] == {reason: PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0 and totals.answered_attempts + totals.settled_attempts == 2 * PROMPTS
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


@pytest.mark.parametrize("mode", ["chat", "stream"])
def test_reconcile_cost_checks_retried_answers_against_their_records_too(
    mode: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """`reconcile_cost` against a provider that bills 1.5x the usage.cost its answers report: kept answers were
    recorded at their records, retried ones (finish_reason "error", half an answer billed) at their usage.cost."""
    failure = FailureRule(kind="finish_error", rate=1.0, attempts=1)
    sim_cfg = SimConfig(seed=9, generation_cost_factor=1.5, failures=(failure,))
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, mode, reconcile_cost=True)
    assert summary["done"] == PROMPTS and summary["retries_by_reason"] == {"finish_error": PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


def test_records_slower_than_one_lookup_are_still_the_bill(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records that took longer than one answer's lookup (20 s against 15.5 s at a billing re-verifier) made the
    run conclude the endpoint keeps none: every answer was recorded at the configured prices, half the bill, and
    the cap was crossed 1.6x. The first lookup waits longer before concluding that, and an answer whose own
    lookup misses stays pending until the end-of-run pass finds its record. (Delays scaled down here.)"""
    from tasks.generate import client

    monkeypatch.setattr(client, "LOOKUP_DELAYS_S", (0.05, 0.05))
    monkeypatch.setattr(client, "RECORDS_PROBE_DELAYS_S", (0.5, 1.0, 1.0))
    sim_cfg = SimConfig(
        seed=7,
        report_cost=False,
        generation_lookup_delay_s=0.8,
        price_prompt_usd_per_mtok=2 * PRICE_PROMPT,
        price_completion_usd_per_mtok=2 * PRICE_COMPLETION,
    )
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "chat")
    assert summary["done"] == PROMPTS
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0 and dict(totals.settled_by) == {"generation": PROMPTS}
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


def test_an_endpoint_without_generation_records_is_looked_up_once(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A priced server without records (a vendor billing per token, a local server): the first cost-less answer
    finds none, the others are not looked up, all are recorded at the configured prices, and the run says so."""
    from tasks.generate import client
    from tasks.generate.progress import RunEvent, add_event_listener

    monkeypatch.setattr(client, "RECORDS_PROBE_DELAYS_S", (0.05, 0.05))
    events: list[RunEvent] = []
    remove = add_event_listener(events.append)
    write_prompts(tmp_path, [question("no-records", i) for i in range(PROMPTS)])
    sim_cfg = SimConfig(  # billing at the configured prices: there the estimate is the bill
        seed=7,
        report_cost=False,
        generation_lookup_delay_s=3600.0,
        price_prompt_usd_per_mtok=PRICE_PROMPT,
        price_completion_usd_per_mtok=PRICE_COMPLETION,
    )
    try:
        with SimulatorServer(tokenizer_dir, sim_cfg) as sim:
            cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "chat", SamplingConfig(max_tokens=512))
            summary = run(cfg, None).total()  # type: ignore[arg-type]
            provider = float(sim.billing()["total_usd"])
            lookups = sim.stats()["generation_lookups"]
    finally:
        remove()
    assert summary["done"] == PROMPTS and sum(lookups.values()) == 3, lookups
    assert SpendLedger.load(tmp_path).totals().counted_usd == pytest.approx(provider, abs=1e-12)
    assert [e.message for e in events if e.kind == "unreconciled"] == [
        f"{PROMPTS} answers carried no usage.cost and the endpoint keeps no generation record for them (GET "
        ".../generation?id=): recorded at the configured prices (endpoint.price_*_usd_per_mtok), an estimate, not "
        "the bill"
    ]


def test_an_unbilled_error_body_is_settled_at_its_zero_record_once_old_enough(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An HTTP 200 error body naming a generation the provider recorded at $0 with no token: the record was read
    as one still being written on every pass, so the attempts stayed pending at worst case for good ($4.13
    against a $0 bill stopped every rerun at its cap; a billing probe). Once the error is old enough that its
    record is written (here at once), $0 is its bill."""
    from tasks.generate import settlement

    monkeypatch.setattr(settlement, "ABSENT_RECORD_GRACE_S", 0.0)
    rule = FailureRule(kind="error_body", rate=1.0, attempts=1, names_generation=True)
    summary, provider = _run(tmp_path, tokenizer_dir, SimConfig(seed=11, failures=(rule,)), "chat")
    assert summary["done"] == PROMPTS and summary["retries_by_reason"] == {"error_body": PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0 and dict(totals.settled_by) == {"generation": PROMPTS}
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


@pytest.mark.parametrize("reconcile", [True, False])
def test_a_generation_record_still_being_written_is_not_the_bill(
    reconcile: bool, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """A record that answers $0 and counts no tokens for a while (then the real figure) was taken as final: paid
    answers were recorded at $0 (with reconcile_cost) and cut streams settled at $0, and the cap stopped nothing.
    Such a record is looked up again, like a 404; a free model's record counts its tokens."""
    rules = () if reconcile else (FailureRule(kind="late_error_body", rate=1.0, attempts=1),)
    sim_cfg = SimConfig(seed=9, generation_unsettled_s=1.0, failures=rules)
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "chat", reconcile_cost=reconcile)
    assert summary["done"] == PROMPTS and provider > 0
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)


@pytest.mark.parametrize("grace_s", [0.0, 5.0])
def test_a_refusal_mid_run_settles_the_streams_it_cut_before_the_command_exits(
    grace_s: float, tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key runs out of credit (402, no Retry-After) while streams are in flight: those that do not end within
    the grace are cancelled, and the provider billed what they generated. The refusal's error settles them from
    their generation records first, so the spend recorded when the command exits is the bill, and the error says
    what was spent. Within the grace (5 s here, long enough for these streams) they finish and are kept."""
    from tasks.common.errors import FatalEndpointError
    from tasks.generate import engine

    monkeypatch.setattr(engine, "REFUSAL_GRACE_S", grace_s)

    write_prompts(tmp_path, [question("refused", i) for i in range(40)])
    sim_cfg = SimConfig(seed=8, key_limit_usd=0.0004, stream_chunk_delay_s=0.02, latency_s=0.05)
    with SimulatorServer(tokenizer_dir, sim_cfg) as sim:
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "stream", SamplingConfig(max_tokens=512), max_in_flight=8)
        with pytest.raises(FatalEndpointError, match="recorded spend") as refused:
            run(cfg, None)  # type: ignore[arg-type]
        provider = float(sim.billing()["total_usd"])
    totals = SpendLedger.load(tmp_path).totals()
    assert "HTTP 402" in str(refused.value)
    if grace_s:  # every paid attempt is an answer kept in a committed chunk
        paid = [a for a in SpendLedger.load(tmp_path).attempts.values() if a.billed_usd > 0]
        done = [r for r in committed_chunks(tmp_path).values() if r["status"] == "done"]
        assert not totals.settled_by and len(done) == len(paid) > 0
    else:
        assert totals.settled_by.get("generation", 0) > 0, "no stream was in flight when the key ran out"
    assert totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)
    # the line printed is what the ledger holds once settled, not what it held before
    assert f"recorded spend: {format_usd(totals.billed_usd)} billed." in str(refused.value)
    assert "pending" not in str(refused.value).split("recorded spend")[1]


def test_answers_with_reasoning_for_a_format_without_it_stop_the_run_early(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A format without a reasoning section (a template that never renders reasoning) cannot hold an answer with
    reasoning: every row would fail at reconstruct after it was paid for. Once the first answers all carry it,
    the run stops with one config error instead of buying the rest; what was answered is kept."""
    from tasks.common.errors import ConfigError
    from tasks.common.shards import PartRef
    from tasks.generate.endpoints import CompletionMarkers
    from tasks.generate.engine import generate_parts
    from tasks.generate.reasoning_guard import FIRST_ANSWERS
    from tests.test_generate_failures import EOS
    from tests.test_generate_money import durable_rows

    prompts = 200
    write_prompts(tmp_path, [question("reasons", i) for i in range(prompts)])
    with SimulatorServer(tokenizer_dir, SimConfig(seed=9)) as sim:
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "stream", SamplingConfig(max_tokens=512))
        no_reasoning = CompletionMarkers(reasoning_close="", end_of_turn=EOS)
        with pytest.raises(ConfigError, match=f"first {FIRST_ANSWERS} answers all carry reasoning"):
            generate_parts(cfg, [PartRef(cfg.run_dir, "prompts", 0)], no_reasoning)
        sent = int(sim.stats()["total_requests"])
    assert FIRST_ANSWERS <= sent < prompts // 2
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.answered_attempts >= FIRST_ANSWERS
    kept = [r for r in durable_rows(tmp_path).values() if r["status"] == "done"]
    assert len(kept) >= FIRST_ANSWERS and all(r["reasoning"] for r in kept)


def test_a_mistyped_key_leaves_nothing_pending(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Every request of a run with a wrong key is refused (401): none is billed. Cancelled the moment the first
    refusal arrived, the others in flight were counted pending at worst case for the life of the run directory
    (21 of 32, 94% of a small cap, never settled: a 401 has no generation id), and the rerun with the right key
    stopped at the cap after 2 samples. They now end with their own refusal, at $0."""
    from tasks.common.errors import FatalEndpointError

    write_prompts(tmp_path, [question("typo", i) for i in range(40)])
    # SGLang's route: its prices are the config's by definition, so the capped window opens at once (32 in flight)
    with SimulatorServer(tokenizer_dir, SimConfig(seed=10, required_api_key="sk-or-GOOD", latency_s=0.05)) as sim:
        settings: dict[str, object] = {"max_in_flight": 32, "max_cost_usd": 0.05, "api_key": "sk-or-TYPO"}
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "sglang", SamplingConfig(max_tokens=512), **settings)
        tokenizer = load_tokenizer(cfg.tokenizer)
        with pytest.raises(FatalEndpointError, match="HTTP 401") as refused:
            run(cfg, tokenizer)
        assert sim.billing()["total_usd"] == 0
        totals = SpendLedger.load(tmp_path).totals()
        assert totals.attempts > 1 and totals.pending_attempts == 0 and totals.counted_usd == 0, totals
        assert "pending" not in str(refused.value)
        settings["api_key"] = "sk-or-GOOD"
        fixed = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "sglang", SamplingConfig(max_tokens=512), **settings)
        summary = run(fixed, tokenizer).total()
        assert summary["done"] == 40 and summary["stopped"] is None


def test_answers_reconciliation_could_not_look_up_are_announced(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`reconcile_cost` asks for the bill's own figure; when no generation record appears, the answer keeps its
    own usage.cost, and the run says how many did (it used to be silent)."""
    from tasks.generate import client
    from tasks.generate.progress import RunEvent, add_event_listener

    monkeypatch.setattr(client, "LOOKUP_DELAYS_S", (0.05,))
    events: list[RunEvent] = []
    remove = add_event_listener(events.append)
    try:
        sim_cfg = SimConfig(seed=11, generation_lookup_delay_s=60.0)
        summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "chat", reconcile_cost=True)
    finally:
        remove()
    assert summary["done"] == PROMPTS
    assert all(r["billed_cost_usd"] is None for r in responses(tmp_path).values())
    assert SpendLedger.load(tmp_path).totals().counted_usd == pytest.approx(provider, abs=1e-12)
    notices = [e.message for e in events if e.kind == "unreconciled"]
    assert len(notices) == 1 and notices[0].startswith(f"{PROMPTS} answers are recorded at their own usage.cost")


@pytest.mark.parametrize("mode", ["chat", "stream"])
def test_an_aborted_generation_without_usage_is_counted_at_its_bill(
    mode: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """finish_reason "error" and no usage at all: the provider still billed what it generated. Booked at $0 (the
    attempt "answered"), a quarter of the bill went unrecorded and nothing could settle it; it is pending until
    its generation record says what it cost."""
    sim_cfg = SimConfig(seed=12, failures=(FailureRule(kind="finish_error_no_usage", rate=1.0, attempts=1),))
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, mode)
    assert summary["done"] == PROMPTS and summary["retries_by_reason"] == {"finish_error": PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0 and dict(totals.settled_by) == {"generation": PROMPTS}
    assert totals.billed_usd == pytest.approx(provider, abs=1e-12)


def test_a_stream_cut_before_its_usage_chunk_keeps_the_answer_and_settles_its_bill(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The finish chunk arrived, then the connection went before the usage chunk: the answer is whole. It used to
    be thrown away and bought again (+65% spend in the probe); it is kept, and its cost settled from the record."""
    sim_cfg = SimConfig(seed=13, failures=(FailureRule(kind="cut_after_finish", rate=1.0, attempts=1),))
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "stream")
    rows = responses(tmp_path).values()
    assert summary["done"] == PROMPTS and not summary["retries_by_reason"]
    assert all(r["attempts"] == 1 and r["finish_reason"] == "stop" and r["content"] for r in rows)
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.attempts == PROMPTS and totals.pending_attempts == 0
    assert totals.billed_usd == pytest.approx(provider, abs=1e-12)


@pytest.mark.parametrize("reconcile", [False, True])
def test_a_byok_answer_counts_what_the_provider_billed_beside_the_fee(
    reconcile: bool, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """On the user's own provider key, usage.cost is OpenRouter's fee alone; the inference was billed by the
    provider (`upstream_inference_cost`). Both were spent: recorded as $0.00 (a 5% fee of nothing), a BYOK run
    went to 3x its cap unseen."""
    sim_cfg = SimConfig(seed=14, byok_fee_fraction=0.05)
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "chat", reconcile_cost=reconcile)
    assert summary["done"] == PROMPTS and provider > 0
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.billed_usd == pytest.approx(provider, abs=1e-12)
    fees = sum(r["cost_usd"] for r in responses(tmp_path).values())
    assert fees == pytest.approx(provider, abs=1e-12), "the row's cost is the fee and the provider's price"


def test_a_generation_record_of_a_request_cancelled_before_its_first_token_settles_at_zero(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """A request cut before generation began gets a record that costs nothing, counts no token and says
    `cancelled`: a real $0. Looked up again as "still being written", it left the attempt pending at its worst
    case forever (2.8x the bill counted against the cap in the probe)."""
    import asyncio

    from tasks.generate.client import EndpointClient
    from tasks.generate.endpoints import CompletionMarkers
    from tests.test_generate_failures import EOS

    with SimulatorServer(tokenizer_dir, SimConfig(seed=15, bill_cancelled=False, latency_s=5.0)) as sim:
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "stream", SamplingConfig(max_tokens=64))

        async def cut_then_look_up() -> float | None:
            async with EndpointClient(cfg, CompletionMarkers("</think>", EOS), None) as client:
                task = asyncio.create_task(client.generate(question("cancel", 0)))
                await asyncio.sleep(0.5)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await asyncio.sleep(0.3)
                (key,) = sim.stats()["by_key"]
                return await client.lookup_cost(f"gen-1-{key}", (0.05,))

        assert asyncio.run(cut_then_look_up()) == 0.0
        assert sim.billing()["total_usd"] == 0


@pytest.mark.slow  # waits for the key's usage to stay stable: make test-long
def test_an_id_less_error_body_is_pending_until_the_account_settles_it(tmp_path: Path, tokenizer_dir: Path) -> None:
    """OpenRouter answers 200 only once the model started, so a 200 whose body is an error may be billed even
    when nothing names its generation (a proxy that drops `X-Generation-Id`): pending at worst case, not $0 (a
    fifth of the probe's bill went unrecorded and the spend passed the cap). The key's account settles it."""
    sim_cfg = SimConfig(seed=16, failures=(FailureRule(kind="error_body", rate=1.0, attempts=1),))
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "chat")
    assert summary["done"] == PROMPTS and summary["retries_by_reason"] == {"error_body": PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == PROMPTS and totals.billed_usd == pytest.approx(provider, abs=1e-12)

    settled = tmp_path / "exclusive"
    settled.mkdir()
    summary, provider = _run(settled, tokenizer_dir, sim_cfg, "chat", account_settlement="exclusive_key")
    totals = SpendLedger.load(settled).totals()
    assert summary["done"] == PROMPTS and totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-9)


def test_the_budget_settles_pending_attempts_before_it_stops_the_run(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Streams cut by an error chunk are pending at their worst case (here 512 completion tokens) until their
    records settle them, which happened only when a run started and ended: the cap stopped the run after a few
    samples at a ninth of what it allowed. Before stopping, the budget now settles them and goes on."""
    from tests.test_generate_failures import PRICE_COMPLETION, PRICE_PROMPT

    prompts = 12
    write_prompts(tmp_path, [question("reclaim", i) for i in range(prompts)])
    worst = (60 * PRICE_PROMPT + 512 * PRICE_COMPLETION) / 1e6
    sim_cfg = SimConfig(seed=17, failures=(FailureRule(kind="midstream_error", rate=1.0, attempts=1),))
    with SimulatorServer(tokenizer_dir, sim_cfg) as sim:
        settings: dict[str, object] = {"max_cost_usd": 8 * worst, "max_in_flight": 2}
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "stream", SamplingConfig(max_tokens=512), **settings)
        summary = run(cfg, None).total()  # type: ignore[arg-type]
        provider = float(sim.billing()["total_usd"])
    assert provider < 8 * worst < prompts * worst, "the bill fits the cap; the cut streams' worst cases do not"
    assert summary["done"] == prompts and summary["stopped"] is None, summary
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0 and totals.counted_usd == pytest.approx(provider, abs=1e-12)


@pytest.mark.parametrize("mode", ["stream", "sglang"])
def test_a_self_hosted_server_without_prices_leaves_nothing_pending(
    mode: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """An answer that reports usage and no cost, with no price table (a local vLLM or SGLang): free, $0, not
    pending (pending, every answer would be looked up in vain at the end of every run)."""
    sim_cfg = SimConfig(seed=18, report_cost=False)
    summary, _ = _run(
        tmp_path, tokenizer_dir, sim_cfg, mode, price_prompt_usd_per_mtok=0.0, price_completion_usd_per_mtok=0.0
    )
    assert summary["done"] == PROMPTS
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == 0 and totals.answered_attempts == PROMPTS and totals.counted_usd == 0


@pytest.mark.parametrize(("status", "id_header"), [(408, True), (524, False), (500, True)])
def test_an_error_status_after_the_answer_was_billed_is_not_free(
    status: int, id_header: bool, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The upstream generated and billed the whole answer, then the client got an error status (a 408 after the
    upstream finished, Cloudflare's 524, a 5xx naming the generation). Booked at $0, 30% of the probe's bill went
    unrecorded and the spend went to 1.9x the cap. Named by `X-Generation-Id`, it is settled from its record;
    an id-less timeout is pending at worst case (never under its bill) until the account can settle it."""
    sim_cfg = SimConfig(
        seed=18,
        generation_id_header=id_header,
        failures=(FailureRule(kind="billed_http", status=status, rate=1.0, attempts=1),),
    )
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "stream")
    assert summary["done"] == PROMPTS and summary["retries_by_reason"] == {f"http_{status}": PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    if id_header:
        assert totals.pending_attempts == 0 and dict(totals.settled_by) == {"generation": PROMPTS}
        assert totals.counted_usd == pytest.approx(provider, abs=1e-12)
    else:
        assert totals.pending_attempts == PROMPTS and totals.counted_usd > provider


@pytest.mark.parametrize("encoding", ["string", "nan", "negative"])
def test_a_cost_written_as_a_string_is_read_and_one_no_bill_can_hold_is_settled_from_the_record(
    encoding: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """`usage.cost` as a string was read as nothing and the answer priced from the config (1.5x the cap against
    a provider's minimum fee); a NaN made the budget wait forever and the ledger's total NaN for good; a negative
    one let the spend pass the cap. A string holding a number is read; the others are pending until the
    generation record settles them."""
    import math

    sim_cfg = SimConfig(seed=19, cost_encoding=encoding, price_completion_usd_per_mtok=7.0)
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "chat", max_cost_usd=1.0)
    assert summary["done"] == PROMPTS
    totals = SpendLedger.load(tmp_path).totals()
    assert math.isfinite(totals.counted_usd) and totals.pending_attempts == 0
    assert totals.counted_usd == pytest.approx(provider, abs=1e-12)
    settled = dict(totals.settled_by)
    assert settled == ({} if encoding == "string" else {"generation": PROMPTS})


@pytest.mark.slow  # two runs that wait out record lookups (25 s alone): make test-long
def test_an_error_naming_a_generation_that_was_never_recorded_settles_at_zero_once_old(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error status naming a generation is pending until its record says what it cost; a provider that names
    generations it never bills writes no record, and 21 such 503s stayed pending at worst case for good, stopping
    every later run at its cap. A lookup that finds no record settles it at $0 once the attempt is older than the
    records' grace; a younger one stays pending."""
    from tasks.generate import settlement

    rule = FailureRule(kind="http", status=500, rate=1.0, attempts=1, names_generation=True)
    sim_cfg = SimConfig(seed=20, failures=(rule,))
    summary, provider = _run(tmp_path, tokenizer_dir, sim_cfg, "stream")
    assert summary["done"] == PROMPTS and summary["retries_by_reason"] == {"http_500": PROMPTS}
    totals = SpendLedger.load(tmp_path).totals()
    assert totals.pending_attempts == PROMPTS, "younger than the grace: a record may still appear"

    monkeypatch.setattr(settlement, "ABSENT_RECORD_GRACE_S", 0.0)
    again = tmp_path / "again"
    again.mkdir()
    summary, provider = _run(again, tokenizer_dir, sim_cfg, "stream")
    totals = SpendLedger.load(again).totals()
    assert totals.pending_attempts == 0 and totals.counted_usd == pytest.approx(provider, abs=1e-12)

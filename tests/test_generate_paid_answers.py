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
from tests.test_generate_failures import committed_chunks, make_cfg, question, responses, run, write_prompts

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

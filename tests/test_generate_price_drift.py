"""The cap holds when the endpoint bills above the configured prices.

Each request reserves its worst case (max_tokens at the configured prices) before it is sent; a provider that
bills 3x those prices made every request "fit" while the spend went to 1.8x the cap (an independent
OpenRouter-like server with its own ledger found it). The budget now counts worst cases at the prices the
endpoint lists (its models listing, before the first request) or has billed (an answer's cost against its own
tokens at the configured prices), and says so in a run event."""

from __future__ import annotations

from pathlib import Path

import pytest

from endpoint_sim.responder import SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.config import SamplingConfig
from tasks.generate.engine import budget_stop_message
from tasks.generate.ledger import SpendLedger
from tasks.generate.progress import RunEvent, add_event_listener
from tests.test_generate_failures import make_cfg, question, run, write_prompts

CONFIGURED = (0.6, 2.5)
BILLED = SimConfig(
    seed=3, reasoning_words=(60, 90), content_words=(60, 90), price_prompt_usd_per_mtok=1.8,
    price_completion_usd_per_mtok=7.5,
)  # fmt: skip
CAP_USD = 0.0012  # at the billed prices one answer of 64 tokens costs ~$0.0005; the 16 prompts ~$0.008


@pytest.mark.parametrize(("model", "in_flight"), [("sim/deepseek-v4-sim", 8), ("sim/unlisted", 8)])
def test_a_provider_billing_three_times_the_configured_prices_stays_under_the_cap(
    tmp_path: Path, tokenizer_dir: Path, model: str, in_flight: int
) -> None:
    """Listed (the listing prices the model at 3x): counted at 3x from the first request. Unlisted: learned from
    the first answer, which is alone in flight until its bill is seen, so nothing else was reserved at the
    configured prices (a whole window of them went to 1.77x the cap)."""
    write_prompts(tmp_path, [question("drift", i) for i in range(16)])
    events: list[RunEvent] = []
    remove = add_event_listener(events.append)
    try:
        with SimulatorServer(tokenizer_dir, BILLED) as sim:
            cfg = make_cfg(
                tmp_path,
                sim.base_url,
                tokenizer_dir,
                "chat",
                SamplingConfig(max_tokens=64),
                model=model,
                max_cost_usd=CAP_USD,
                max_in_flight=in_flight,
                price_prompt_usd_per_mtok=CONFIGURED[0],
                price_completion_usd_per_mtok=CONFIGURED[1],
            )
            summary = run(cfg, None).total()  # type: ignore[arg-type]
            bill = sim.billing()["total_usd"]
    finally:
        remove()
    ledger = SpendLedger.load(tmp_path).totals()
    assert summary["stopped"] == "budget" and 0 < bill <= CAP_USD, (bill, summary)
    assert ledger.counted_usd == pytest.approx(bill, abs=1e-12)
    drift = [e for e in events if e.kind == "price_drift"]
    assert len(drift) == 1 and "3.00x" in drift[0].message, [e.message for e in events]
    listed = "models listing" in drift[0].message
    assert listed == (model == "sim/deepseek-v4-sim"), drift[0].message


def test_the_stop_message_never_claims_a_cap_it_crossed() -> None:
    assert "never crosses the cap" in budget_stop_message(0.9, 1.0)
    crossed = budget_stop_message(1.25, 1.0)
    assert "never crosses" not in crossed and "$0.25" in crossed and "over it" in crossed


def test_the_stop_message_blames_prices_only_for_a_bill_over_the_cap() -> None:
    """$7.75 counted against a $5 cap, of which $0.68 billed and the rest pending worst cases of requests a dead
    endpoint never billed: the message said the endpoint billed above the configured prices. Only a bill over the
    cap says so; pending spend over it says what settles it."""
    pending = budget_stop_message(7.75, 5.0, pending_usd=7.07)
    assert "billed above" not in pending and "set the prices" not in pending
    assert "$2.75 over it only by the pending attempts' worst case" in pending and "$0.6800, is under it" in pending
    assert "exclusive_key" in pending and "rerun later" in pending and "raise endpoint.max_cost_usd" in pending
    held = budget_stop_message(4.99, 5.0, pending_usd=3.0)
    assert "never crosses the cap" in held and "pending attempts hold part of it" in held and "exclusive_key" in held
    settled_by_key = budget_stop_message(7.75, 5.0, pending_usd=7.07, account_settlement="exclusive_key")
    assert "set endpoint.account_settlement" not in settled_by_key and "the key's usage then settles" in settled_by_key
    billed = budget_stop_message(5.5, 5.0, pending_usd=0.25)
    assert "$0.2500 billed over it: the endpoint billed above the configured" in billed

"""Random mixes of every failure the simulator injects, with the money settings that change how answers are booked:
the run must end, every sample exactly once, and the spend ledger must be the provider's bill.

The targeted tests each inject one failure kind. Mixed, they found two defects none of them could: a trial request
whose stream failed as its own sample's left the breaker waiting forever (a 503 burst, then an error chunk), and
retried answers booked at the configured prices or the answer's usage.cost where the ledger follows the generation
record for kept ones. Each seed draws a mode (chat, streamed chat, /generate), up to seven failure rules (any kind,
status, attempts, with or without a generation id), a cap, a provider billing above what its answers report,
answers without usage.cost, reconciliation and settlement; the draw is printed when a seed fails.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, get_args

import pytest

from endpoint_sim.responder import FailureKind, FailureRule, SimConfig
from endpoint_sim.server import SimulatorServer
from tasks.common.config import TokenizerConfig
from tasks.common.errors import EndpointUnavailableError
from tasks.generate.chunks import chunk_paths, read_chunk
from tasks.reconstruct.tokenizer_loading import load_tokenizer
from tests.test_generate_failures import (
    PRICE_COMPLETION,
    PRICE_PROMPT,
    make_cfg,
    question,
    responses,
    run,
    write_prompts,
)
from tests.test_generate_money import billed, check_ledger_against_provider

SEEDS = range(32)
# Every kind but two: "empty_reasoning" is retried only under require_reasoning, "echo_key" tests redaction.
KINDS: tuple[FailureKind, ...] = tuple(k for k in get_args(FailureKind) if k not in ("empty_reasoning", "echo_key"))
STATUSES = (500, 502, 503, 504, 429, 408, 524)


def draw(seed: int) -> tuple[str, int, SimConfig, dict[str, Any]]:
    """One mix: mode, number of prompts, the simulator's config and the endpoint settings."""
    rng = random.Random(seed)
    mode = rng.choice(["chat", "stream", "sglang"])
    rules, left = [], 0.8
    for _ in range(rng.randint(1, 7)):
        rate = min(left, rng.choice([0.05, 0.1, 0.2]))
        left -= rate
        if rate <= 0:
            break
        kind = rng.choice(KINDS)
        rules.append(
            FailureRule(
                kind=kind,
                status=rng.choice(STATUSES) if kind in ("http", "billed_http") else 500,
                rate=rate,
                attempts=rng.choice([1, 2, None]),
                hang_s=2.0,
                retry_after_s=rng.choice([None, 0.05]),
                names_generation=rng.random() < 0.3,
            )
        )
    chat = mode != "sglang"
    endpoint: dict[str, Any] = {
        "max_attempts": rng.choice([2, 3]),
        "max_in_flight": rng.choice([1, 4, 16]),
        "outage_probe_min_s": 0.01,
        "outage_probe_max_s": 0.1,
        "request_timeout_s": 1.0,
        "outage_abort_s": 20.0,
        "max_cost_usd": rng.choice([None, 0.01, 0.03]),  # one worst case is ~$0.003: room for 3 and 10
        "reconcile_cost": chat and rng.random() < 0.3,
        "settle_pending": rng.random() < 0.8,
    }
    report_cost = not chat or rng.random() < 0.7
    # Drift the answer does not show is the records' business: drawn only where the run reads them.
    reads_records = endpoint["reconcile_cost"] or (not report_cost and endpoint["settle_pending"])
    sim = SimConfig(
        seed=seed,
        failures=tuple(rules),
        report_cost=report_cost,
        generation_cost_factor=rng.choice([1.0, 2.0]) if chat and reads_records else 1.0,
        latency_lognormal=rng.choice([None, (-3.0, 0.5)]),
        price_prompt_usd_per_mtok=PRICE_PROMPT,
        price_completion_usd_per_mtok=PRICE_COMPLETION,
    )
    return mode, rng.choice([20, 60]), sim, endpoint


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_failure_mix_ends_with_every_sample_once_and_the_bill_recorded(
    seed: int, tmp_path: Path, tokenizer_dir: Path
) -> None:
    mode, n, sim_cfg, endpoint = draw(seed)
    mix = json.dumps({"mode": mode, "n": n, "sim": sim_cfg.model_dump(exclude_defaults=True), **endpoint})
    print(mix)  # shown with a failure: the draw to reproduce
    write_prompts(tmp_path, [question(f"mix{seed}", i) for i in range(n)])
    with SimulatorServer(tokenizer_dir, sim_cfg) as sim:
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, mode, **endpoint)
        tokenizer = load_tokenizer(TokenizerConfig(path=tokenizer_dir)) if mode == "sglang" else None
        try:
            total: dict[str, Any] | None = run(cfg, tokenizer).total()  # type: ignore[arg-type]
        except EndpointUnavailableError:
            total = None  # a mix that fails every request for outage_abort_s stops resumably
        if total is not None and not total["stopped"]:
            got = responses(tmp_path)
            assert len(got) == n and {r["status"] for r in got.values()} <= {"done", "failed"}, mix
            assert total["done"] + total["failed"] == n, mix
        else:  # stopped at the cap or by the outage rule: what it committed, each sample once
            kept = [row for path in chunk_paths(tmp_path, 0) for row in read_chunk(path)]
            assert len({row["sample_id"] for row in kept}) == len(kept), mix
        if mode != "sglang":
            check_ledger_against_provider(tmp_path, sim)
        bill = sum(r["cost_usd"] for r in billed(sim))
        if endpoint["max_cost_usd"] is not None:
            assert bill <= endpoint["max_cost_usd"] + 1e-12, mix

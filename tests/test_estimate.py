"""`eagle3-datagen estimate` against the real simulator: exact prompt tokens, a cost within 10% of what the run
then records, nothing sent to the endpoint, prices from the models listing, and the refusal above the cap."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from endpoint_sim.server import SimulatorServer
from flows.cli import demo_config_path, generate_without_prefect, main
from tasks.common.config import PipelineConfig, load_config
from tasks.common.shards import done_parts, read_part
from tasks.estimate.display import estimate_text
from tasks.estimate.errors import EstimateOverBudgetError
from tasks.estimate.estimate import check_budget, estimate_run
from tasks.generate.ledger import LedgerWriter


def _overrides(run_dir: Path, sim: SimulatorServer, tokenizer_dir: Path, **extra: Any) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir),
        "endpoint.base_url": sim.base_url,
        "tokenizer.path": str(tokenizer_dir),
        "extract.enabled": False,
        **extra,
    }


def _set_args(overrides: dict[str, Any]) -> list[str]:
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={json.dumps(value)}")]


def _recorded(run_dir: Path) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for ref in done_parts(run_dir, "responses"):
        for row in read_part(ref, ["dataset", "cost_usd", "prompt_tokens"]).to_pylist():
            d = out.setdefault(row["dataset"], {"cost_usd": 0.0, "prompt_tokens": 0})
            d["cost_usd"] += row["cost_usd"] or 0.0
            d["prompt_tokens"] += row["prompt_tokens"] or 0
    return out


def _completion_requests(sim: SimulatorServer) -> int:
    stats = sim.stats()
    return int(stats["total_requests"]) + sum(n for r, n in stats["by_route"].items() if r != "models_listing")


def test_demo_estimate_is_within_10_percent_of_the_run_and_sends_nothing(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # an earlier run of the same config with another seed: the observed completion lengths and latencies
    earlier = load_config(
        demo_config_path(), _overrides(tmp_path / "earlier", sim, tokenizer_dir, **{"sampling.seed": 1})
    )
    generate_without_prefect(earlier)

    sim.reset_stats()
    overrides = _overrides(tmp_path / "run", sim, tokenizer_dir)
    code = main(
        ["estimate", str(demo_config_path()), *_set_args(overrides), "--observed", str(earlier.run_dir), "--json"]
    )
    assert code == 0
    estimate = json.loads(capsys.readouterr().out)
    assert _completion_requests(sim) == 0, f"estimate sent requests: {sim.stats(with_keys=False)}"
    assert not (tmp_path / "run").exists(), "estimate must not write into the run directory"

    cfg = load_config(demo_config_path(), overrides)
    summary, _ = generate_without_prefect(cfg)
    recorded = _recorded(cfg.run_dir)
    total = sum(d["cost_usd"] for d in recorded.values())
    assert summary.total()["done"] == estimate["requests"] == 80
    cost = estimate["cost_usd"]
    assert cost["low"] <= total <= cost["high"]
    print(f"estimate low/expected/high {cost}, recorded {total}")
    assert abs(cost["expected"] - total) / total < 0.10, (cost, total)
    for row in estimate["datasets"]:  # sglang_generate: the server counts the ids we rendered, so exactly equal
        assert row["prompt_tokens"] == recorded[row["dataset"]]["prompt_tokens"], row["dataset"]
    assert estimate["wall_s"]["expected"] is not None and estimate["latency_s_mean"] is not None

    again = estimate_run(cfg)  # the finished run: nothing left to buy
    assert again.requests == 0 and again.cost_usd("high") == 0.0 and again.spent_usd == pytest.approx(total)

    # Money no done row shows (a paid answer a kill cut before its row was committed, a request still pending
    # at worst case) is in the ledger, and so in what the estimate says is spent and what the cap check counts.
    writer = LedgerWriter(cfg.run_dir, 0.0)
    writer.ended(writer.sent("lost", "ds", 0, 0.05), "answered", 0.004, None, None)
    writer.ended(writer.sent("cut", "ds", 0, 0.07), "pending", None, None, "killed")
    writer.close()
    counted = estimate_run(cfg)
    assert counted.spent_usd == pytest.approx(total + 0.004) and counted.pending_usd == pytest.approx(0.07)
    assert "(+ $0.0700 pending at worst case)" in estimate_text(counted)


def test_prices_come_from_the_models_listing_when_the_config_has_none(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    raw = load_config(demo_config_path()).model_dump(mode="json")
    raw["endpoint"].update(kind="openai_chat", model=sim.config.model_name)
    raw["endpoint"].pop("price_prompt_usd_per_mtok")
    raw["endpoint"].pop("price_completion_usd_per_mtok")
    raw.update(run_dir=str(tmp_path / "run"), tokenizer={**raw["tokenizer"], "path": str(tokenizer_dir)})
    raw["endpoint"]["base_url"] = sim.base_url
    cfg = PipelineConfig.model_validate(raw)
    sim.reset_stats()
    estimate = estimate_run(cfg)
    assert estimate.prices.source.startswith("models listing")
    assert (estimate.prices.prompt_usd_per_mtok, estimate.prices.completion_usd_per_mtok) == pytest.approx(
        (sim.config.price_prompt_usd_per_mtok, sim.config.price_completion_usd_per_mtok)
    )
    assert _completion_requests(sim) == 0 and sim.stats()["by_route"]["models_listing"] == 1
    offline = estimate_run(cfg, price_lookup=False)
    assert not offline.prices.known and offline.cost_usd("low") is None

    # Configured prices are checked against the listing: answers without usage.cost are recorded at them.
    listed = {"price_prompt_usd_per_mtok": sim.config.price_prompt_usd_per_mtok}
    listed["price_completion_usd_per_mtok"] = sim.config.price_completion_usd_per_mtok
    agreeing = PipelineConfig.model_validate({**raw, "endpoint": {**raw["endpoint"], **listed}})
    assert estimate_run(agreeing).prices.disagreement is None
    wrong = {**listed, "price_completion_usd_per_mtok": listed["price_completion_usd_per_mtok"] * 1.25}
    differing = PipelineConfig.model_validate({**raw, "endpoint": {**raw["endpoint"], **wrong}})
    warned = estimate_run(differing)
    assert warned.prices.source == "endpoint.price_*_usd_per_mtok"
    assert warned.prices.disagreement and "differ from the endpoint's models listing" in warned.prices.disagreement
    assert "warning: endpoint.price_*_usd_per_mtok" in estimate_text(warned)
    assert estimate_run(differing, price_lookup=False).prices.disagreement is None


def test_a_cap_below_the_low_end_is_refused_before_anything_is_sent(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = _overrides(tmp_path / "run", sim, tokenizer_dir, **{"endpoint.max_cost_usd": 0.0001})
    cfg = load_config(demo_config_path(), overrides)
    estimate = estimate_run(cfg)
    low = estimate.cost_usd("low")
    assert low is not None and low > 0.0001
    with pytest.raises(EstimateOverBudgetError, match="max_cost_usd"):
        check_budget(estimate)
    sim.reset_stats()
    assert main(["estimate", str(demo_config_path()), *_set_args(overrides)]) == 3
    assert "exceeds endpoint.max_cost_usd" in capsys.readouterr().err
    assert _completion_requests(sim) == 0


@pytest.mark.usefixtures("prefect_harness")
def test_the_flow_estimates_first_stops_on_dry_run_and_refuses_above_the_cap(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    from prefect.artifacts import Artifact

    from flows.params import RunParameters
    from flows.pipeline import pipeline

    sim.reset_stats()
    dry = RunParameters(
        config_path=str(demo_config_path()), overrides=_overrides(tmp_path / "dry", sim, tokenizer_dir), dry_run=True
    )
    state = pipeline(dry, return_state=True)
    assert state.is_completed() and (state.message or "").startswith("DryRun: nothing was sent")
    stats = state.result()
    assert stats["dry_run"] and stats["estimate"]["requests"] == 80
    assert "prompt tokens (exact)" in stats["estimate"]["text"]
    estimate = Artifact.get("estimate-dry")
    assert estimate is not None and "nothing sent" in str(estimate.data)
    assert _completion_requests(sim) == 0 and not (tmp_path / "dry" / "responses").exists()

    capped = RunParameters(
        config_path=str(demo_config_path()),
        overrides=_overrides(tmp_path / "capped", sim, tokenizer_dir, **{"endpoint.max_cost_usd": 0.0001}),
    )
    state = pipeline(capped, return_state=True)
    assert state.is_failed() and "exceeds endpoint.max_cost_usd" in (state.message or "")
    assert _completion_requests(sim) == 0


def test_after_a_kill_the_estimate_counts_journaled_answers_as_bought_and_pending_ones_as_unsettled(
    sim: SimulatorServer, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """What a `kill -9` leaves: answers in the journal (replayed by the next run, never bought again) and attempts
    pending at their worst case (settled when generate starts). The estimate counted the first as requests to buy
    and refused the rerun over the second, so every rerun after the kill exited 3 though the cap had room."""
    from tasks.common.shards import PartRef
    from tasks.estimate.estimate import over_budget
    from tasks.generate.chunks import journal_dir
    from tasks.generate.journal import AppendLog
    from tasks.generate.ledger import LedgerWriter

    run_dir = tmp_path / "run"
    cfg = load_config(demo_config_path(), _overrides(run_dir, sim, tokenizer_dir))
    from tasks.prepare.datasets import prepare_datasets

    prepare_datasets(cfg)
    fresh = estimate_run(cfg, price_lookup=False)
    prompts = read_part(PartRef(run_dir, "prompts", 0), ["sample_id", "dataset"]).to_pylist()
    journal = AppendLog(journal_dir(run_dir) / "journal-1-1.log", group_commit_s=0.0)
    for row in prompts[:5]:
        journal.submit({"p": 0, "r": {**row, "status": "done", "completion_tokens": 40, "latency_s": 1.0}})
    journal.close()
    assert estimate_run(cfg, price_lookup=False).requests == fresh.requests - 5

    low = fresh.cost_usd("low")
    assert low is not None
    writer = LedgerWriter(run_dir, group_commit_s=0.0)
    writer.sent(prompts[6]["sample_id"], prompts[6]["dataset"], 0, 10 * low)  # killed in flight: pending
    uid = writer.sent(prompts[7]["sample_id"], prompts[7]["dataset"], 0, 0.01)
    writer.ended(uid, "answered", low / 10, "gen-1", None)
    writer.close()
    now = estimate_run(cfg, price_lookup=False)
    now_low = now.cost_usd("low")
    assert now_low is not None and now.pending_usd == 10 * low
    cap = now.spent_usd + 1.01 * now_low
    assert now.counted_usd + now_low > cap  # what refused every rerun
    with_room = load_config(
        demo_config_path(), _overrides(run_dir, sim, tokenizer_dir, **{"endpoint.max_cost_usd": cap})
    )
    assert over_budget(estimate_run(with_room, price_lookup=False)) is None
    short = now.spent_usd + 0.99 * now_low
    billed_out = load_config(
        demo_config_path(), _overrides(run_dir, sim, tokenizer_dir, **{"endpoint.max_cost_usd": short})
    )
    assert "already billed" in (over_budget(estimate_run(billed_out, price_lookup=False)) or "")


def test_a_rerun_is_estimated_without_the_failures_it_does_not_send_again(
    tiny_model_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Deterministic failures under the same settings are not bought again (`rerun_policy`): the estimate
    counted them as requests to send, so a cap that covered the rerun's real need (5 requests) was refused
    for 78. With `retry_failed: all` they are sent again, and counted."""
    from endpoint_sim.responder import FailureRule, SimConfig

    faults = SimConfig(failures=(FailureRule(kind="context_length", rate=0.5),))
    with SimulatorServer(tiny_model_dir, faults) as sim:
        overrides = _overrides(tmp_path / "run", sim, tokenizer_dir)
        assert main(["generate", str(demo_config_path()), "--no-progress", *_set_args(overrides)]) != 0
    rows = [r for ref in done_parts(tmp_path / "run", "responses") for r in read_part(ref).to_pylist()]
    failed = sum(r["status"] == "failed" for r in rows)
    assert failed > 20 and failed + sum(r["status"] == "done" for r in rows) == len(rows) == 80
    cfg = load_config(demo_config_path(), overrides)
    rerun = estimate_run(cfg, price_lookup=False)
    assert rerun.requests == 0
    assert sum(d.samples_failed_kept for d in rerun.datasets) == failed
    assert "failed, not sent again" in estimate_text(rerun)
    again = estimate_run(load_config(demo_config_path(), {**overrides, "endpoint.retry_failed": "all"}), False)
    assert sum(d.samples_failed_kept for d in again.datasets) == 0
    assert again.requests == failed

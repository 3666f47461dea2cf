"""Provider parity: the statistics name a provider whose answers the target scores worse beyond the margin (and
only then), the report section, artifact lines, gate and routing hint say so; the simulator routes requests to
several providers by OpenRouter's `provider` object or a stable hash. The end-to-end runs (the target itself
against a noised copy of it, and against an unperturbed second provider) are in `make test-long`."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pytest

from endpoint_sim.providers import ProviderPool, SimProvider
from endpoint_sim.responder import Responder, SimConfig
from endpoint_sim.server import SimulatorServer
from flows.exit_codes import ExitCode, exit_code_for
from tasks.common.config import ScoringConfig
from tasks.common.schemas import RESPONSES, SCORES_STAGE
from tasks.common.shards import PartRef, write_part
from tasks.extract.scores import sample_scores, scores_table
from tasks.scoring.parity import compare
from tasks.scoring.report import ProviderParityError, check_parity_gate, publish_score_report, summarize_scores


def _normal(n: int, mean: float, sd: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_a_provider_worse_beyond_the_margin_is_named_and_equal_ones_are_not() -> None:
    worse = compare("mean_nll", {"d": _normal(40, 1.3, 0.1, 1)}, {"d": _normal(40, 1.0, 0.1, 2)}, margin=0.05)
    assert worse.difference == pytest.approx(0.3, abs=0.05) and worse.ci95_low is not None and worse.ci95_low > 0.2
    assert worse.p_worse_beyond_margin is not None and worse.p_worse_beyond_margin < 1e-6
    assert worse.beyond_margin(confidence=0.99, min_samples=30)
    equal = compare("mean_nll", {"d": _normal(40, 1.0, 0.1, 3)}, {"d": _normal(40, 1.0, 0.1, 4)}, margin=0.05)
    assert not equal.beyond_margin(confidence=0.99, min_samples=30)
    within = compare("mean_nll", {"d": _normal(400, 1.02, 0.1, 5)}, {"d": _normal(400, 1.0, 0.1, 6)}, margin=0.05)
    assert within.p_worse is not None and within.p_worse < 0.05, "a real but small difference is seen ..."
    assert not within.beyond_margin(0.99, 30), "... and not named: it is inside the margin"
    few = compare("mean_nll", {"d": _normal(5, 2.0, 0.1, 7)}, {"d": _normal(40, 1.0, 0.1, 8)}, margin=0.05)
    assert not few.beyond_margin(0.99, 30), "five samples never name a provider"
    top1 = compare("top1_rate", {"d": _normal(40, 0.6, 0.05, 9)}, {"d": _normal(40, 0.9, 0.05, 10)}, margin=0.02)
    assert top1.difference == pytest.approx(0.3, abs=0.05) and top1.beyond_margin(0.99, 30)


def test_a_provider_that_served_the_harder_dataset_is_not_blamed_for_it() -> None:
    """Within each dataset the provider equals the rest; it served mostly the hard one. Pooled, it would look
    1 nat worse; stratified by dataset it is not."""
    provider = {"hard": _normal(60, 3.0, 0.1, 11), "easy": _normal(5, 1.0, 0.1, 12)}
    rest = {"hard": _normal(5, 3.0, 0.1, 13), "easy": _normal(60, 1.0, 0.1, 14)}
    pooled = np.mean(provider["hard"] + provider["easy"]) - np.mean(rest["hard"] + rest["easy"])
    assert pooled > 1.5
    c = compare("mean_nll", provider, rest, margin=0.05)
    assert abs(c.difference or 1) < 0.1 and not c.beyond_margin(0.99, 30) and c.datasets == 2


def write_responses(run_dir: Path, serving: dict[str, tuple[str, str]], part: int = 0) -> None:
    """sample_id -> (dataset, provider): done responses with only the columns the report reads filled."""
    n = len(serving)
    required: dict[str, list[Any]] = {
        "sample_id": list(serving),
        "dataset": [d for d, _ in serving.values()],
        "status": ["done"] * n,
        "attempts": [1] * n,
        "provider": [p for _, p in serving.values()],
    }
    columns = {f.name: required.get(f.name, [None] * n) for f in RESPONSES}
    write_part(PartRef(run_dir, "responses", part), pa.table(columns, schema=RESPONSES), {"test": True})


def write_scores(run_dir: Path, rows: dict[str, tuple[str, float, float]], part: int = 0) -> None:
    """sample_id -> (dataset, mean NLL, top-1 rate): 20 tokens each with that mean and rate."""
    built = []
    for mean, rate in ((m, r) for _, m, r in rows.values()):
        logprobs = np.full(20, -mean, dtype=np.float32)
        top1 = np.arange(20) < round(rate * 20)
        built.append(sample_scores(logprobs, top1, 1e-4))
    table = scores_table(list(rows), [d for d, _, _ in rows.values()], built)
    write_part(PartRef(run_dir, SCORES_STAGE, part), table, {"test": True})


def synthetic_run(run_dir: Path, bad_shift: float, n: int = 40) -> None:
    """Providers A and B serve datasets X and Y; C serves both with its NLL shifted by `bad_shift`."""
    rng = random.Random(0)
    serving: dict[str, tuple[str, str]] = {}
    rows: dict[str, tuple[str, float, float]] = {}
    for i in range(3 * n):
        provider = "ABC"[i % 3]
        dataset = "XY"[(i // 3) % 2]
        base = 1.0 if dataset == "X" else 2.0
        shift = bad_shift if provider == "C" else 0.0
        sid = f"s{i:04d}"
        serving[sid] = (dataset, provider)
        rate = 0.9 - (0.3 if provider == "C" and bad_shift else 0.0) + rng.uniform(-0.05, 0.05)
        rows[sid] = (dataset, base + shift + rng.gauss(0, 0.1), rate)
    write_responses(run_dir, serving)
    write_scores(run_dir, rows)


def test_report_gate_and_routing_hint_name_the_worse_provider(tmp_path: Path) -> None:
    synthetic_run(tmp_path, bad_shift=0.4)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "report.md").write_text("# Validation report\n\nbody\n")
    scfg = ScoringConfig(parity_gate="fail")
    report = publish_score_report(tmp_path, scfg)
    summary = report.summary
    assert summary["named"] == ["C"] and summary["scored_samples"] == 120
    line = summary["named_lines"][0]
    assert "'C'" in line and "40 vs 80 samples over 2 datasets" in line
    nll, top1 = (float(m) for m in re.findall(r"(?:mean NLL|top-1 rate) ([+-][0-9.]+)", line))
    assert nll == pytest.approx(0.4, abs=0.05) and top1 == pytest.approx(-0.3, abs=0.03)
    assert summary["routing_hint"] == {"order": ["A", "B"], "ignore": ["C"]} or summary["routing_hint"] == {
        "order": ["B", "A"],
        "ignore": ["C"],
    }
    md = (tmp_path / "reports" / "report.md").read_text()
    assert md.startswith("# Validation report") and "## Provider parity" in md and "NAMED" in md
    assert "provider_routing: {order:" in md and json.loads(report.path.read_text())["summary"]["named"] == ["C"]
    with pytest.raises(ProviderParityError, match="'C'") as err:
        check_parity_gate(summary, scfg)
    assert exit_code_for(err.value) == ExitCode.GATES
    check_parity_gate(summary, ScoringConfig(parity_gate="warn"))
    off = summarize_scores(tmp_path, ScoringConfig(parity_gate="off"))
    assert off["named"] == [] and [p["beyond_margin"] for p in off["providers"]] == [False, False, True]
    check_parity_gate(off, ScoringConfig(parity_gate="fail"))  # nothing named: nothing to fail
    wide = summarize_scores(tmp_path, ScoringConfig(parity_margin_nll_nats=1.0, parity_margin_top1_rate=0.5))
    assert wide["named"] == [], "a difference inside both margins names no one"


def test_equal_providers_name_no_one_and_reports_are_reused(tmp_path: Path) -> None:
    synthetic_run(tmp_path, bad_shift=0.0)
    scfg = ScoringConfig(parity_gate="fail")
    report = publish_score_report(tmp_path, scfg)
    assert report.summary["named"] == [] and all(p["judged"] for p in report.summary["providers"])
    check_parity_gate(report.summary, scfg)
    stamp = report.path.stat().st_mtime_ns
    assert publish_score_report(tmp_path, scfg).summary == report.summary
    assert report.path.stat().st_mtime_ns == stamp, "unchanged parts and settings: summary.json reused"
    few = summarize_scores(tmp_path, ScoringConfig(parity_min_samples=1000))
    assert not any(p["judged"] for p in few["providers"]) and few["routing_hint"] is None


@pytest.fixture(scope="module")
def pool_server(tokenizer_dir: Path) -> Any:
    a = Responder(tokenizer_dir, SimConfig())
    b = Responder(tokenizer_dir, SimConfig(seed=7))
    pool = ProviderPool([SimProvider("Alpha-Host", a, "bf16"), SimProvider("beta", b, "fp8")])
    with SimulatorServer(tokenizer_dir, SimConfig(), responder=pool) as server:
        yield server


def _asker(server: SimulatorServer, client: httpx.Client) -> Any:
    def ask(text: str, routing: dict[str, Any] | None = None) -> httpx.Response:
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}]}
        if routing is not None:
            body["provider"] = routing
        return client.post(f"{server.base_url}/v1/chat/completions", json=body)

    return ask


def test_simulator_routes_by_openrouter_provider_object_or_stable_hash(pool_server: SimulatorServer) -> None:
    with httpx.Client(timeout=30) as client:
        _check_routing(pool_server, _asker(pool_server, client))


def _check_routing(pool_server: SimulatorServer, _ask: Any) -> None:
    served = {_ask(f"q{i}").json()["provider"] for i in range(24)}
    assert served == {"Alpha-Host", "beta"}, "hash routing spreads requests over both"
    first = _ask("same question").json()
    assert _ask("same question").json()["provider"] == first["provider"], "a rerun meets the same host"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"order": ["BETA", "alpha-host"]}, "beta"),
        ({"order": ["alphahost"], "allow_fallbacks": False}, "Alpha-Host"),
        ({"only": ["alpha host"]}, "Alpha-Host"),
        ({"ignore": ["Alpha-Host"]}, "beta"),
        ({"quantizations": ["fp8"]}, "beta"),
        ({"order": ["gamma"], "ignore": ["beta"]}, "Alpha-Host"),
    ]
    for routing, expected in cases:
        for i in range(4):
            assert _ask(f"r{i}", routing).json()["provider"] == expected, routing
    for refused in ({"only": ["gamma"]}, {"order": ["gamma"], "allow_fallbacks": False}, {"quantizations": ["int4"]}):
        reply = _ask("refused", refused)
        assert reply.status_code == 404 and "No endpoints found" in reply.json()["error"]["message"], refused
    answer = _ask("q0", {"only": ["beta"]}).json()["choices"][0]["message"]
    alone = Responder(pool_server.model_dir, SimConfig(seed=7)).sample_for_messages([{"role": "user", "content": "q0"}])
    assert answer["content"] == alone.content, "the chosen provider's own responder answered"

"""What a run will cost and how long it will take, before it sends anything: exact prompt tokens from the
tokenizer, completion tokens from `sampling.max_tokens` or from a finished run directory's observed distribution,
prices from the config or the models listing, wall time from `endpoint.max_in_flight` and observed latencies.

Invariant: estimating sends no completion request and writes nothing to the run directory. Samples the run
directory already holds as "done", and failed samples the next run does not send again (`rerun_policy`: a
deterministic failure under the same settings), are not counted (a rerun is estimated for what it still has to
buy: counting 73 kept `context_length` failures refused a rerun that sent 5 requests).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig
from tasks.common.errors import ConfigError, EmptyInputError
from tasks.common.messages import Message, response_sample_id, sample_id
from tasks.common.shards import done_parts, read_part
from tasks.estimate.errors import EstimateOverBudgetError
from tasks.estimate.prices import Prices, resolve_prices
from tasks.generate.chunks import STAGE, unfinished_answer_rows
from tasks.generate.ledger import SpendLedger, SpendTotals
from tasks.prepare.datasets import MalformedRow, _raw_rows, normalize_row
from tasks.reconstruct.tokenizer_loading import load_tokenizer, render_prompt_ids

OBSERVED_COLUMNS = ["sample_id", "dataset", "status", "failure_reason", "completion_tokens", "latency_s"]
LOW_QUANTILE = 0.1


@dataclass
class DatasetEstimate:
    dataset: str
    rows_read: int = 0
    quarantined: int = 0
    samples_total: int = 0
    samples_done: int = 0
    samples_failed_kept: int = 0
    """failed deterministically under the same settings: the next run does not send them again"""
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens_low: int = 0
    completion_tokens_expected: int = 0
    completion_tokens_high: int = 0
    completion_source: str = ""


@dataclass
class Observed:
    """Completion tokens and latencies of finished samples, per dataset, from one run directory."""

    run_dir: Path | None = None
    completion_tokens: dict[str, list[int]] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)

    def pooled(self) -> list[int]:
        return [n for values in self.completion_tokens.values() for n in values]


@dataclass
class RunEstimate:
    model: str
    datasets: list[DatasetEstimate]
    prices: Prices
    max_in_flight: int
    max_tokens: int
    max_cost_usd: float | None
    spent_usd: float
    pending_usd: float
    observed_from: str | None
    latency_s_mean: float | None
    latency_s_p90: float | None

    @property
    def requests(self) -> int:
        return sum(d.requests for d in self.datasets)

    @property
    def counted_usd(self) -> float:
        """What the cost cap already counts in this run directory: billed, plus pending at worst case."""
        return self.spent_usd + self.pending_usd

    def cost_usd(self, which: str) -> float | None:
        if not self.prices.known:
            return None
        prompt = sum(d.prompt_tokens for d in self.datasets) * self.prices.prompt_usd_per_mtok
        completion = sum(getattr(d, f"completion_tokens_{which}") for d in self.datasets)
        return (prompt + completion * self.prices.completion_usd_per_mtok) / 1e6

    def wall_s(self, which: str) -> float | None:
        """Requests keep `max_in_flight` busy: total latency / window, plus one slow request's tail."""
        if self.latency_s_mean is None or not self.requests:
            return None if self.requests else 0.0
        window = min(self.max_in_flight, self.requests)
        rounds = self.requests / window
        if which == "low":
            return rounds * self.latency_s_mean
        tail = max((self.latency_s_p90 or self.latency_s_mean) - self.latency_s_mean, 0.0)
        if which == "expected":
            return rounds * self.latency_s_mean + tail
        return math.ceil(rounds) * (self.latency_s_p90 or self.latency_s_mean)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "requests": self.requests,
            "datasets": [asdict(d) for d in self.datasets],
            "prices": asdict(self.prices),
            "max_in_flight": self.max_in_flight,
            "max_tokens": self.max_tokens,
            "max_cost_usd": self.max_cost_usd,
            "spent_usd": self.spent_usd,
            "pending_usd": self.pending_usd,
            "observed_from": self.observed_from,
            "latency_s_mean": self.latency_s_mean,
            "cost_usd": {w: self.cost_usd(w) for w in ("low", "expected", "high")},
            "wall_s": {w: self.wall_s(w) for w in ("low", "expected", "high")},
        }


def _response_rows(run_dir: Path) -> Iterator[dict[str, Any]]:
    """Every response row a run directory holds: finished parts, then committed chunks and the answer journal of
    unfinished ones (journaled answers are replayed, not bought again: counted as to buy, 20 answers a killed
    run had journaled made the estimate ask for 56 requests where 36 remained)."""
    finished = set()
    for ref in done_parts(run_dir, STAGE):
        finished.add(ref.part)
        yield from read_part(ref, columns=OBSERVED_COLUMNS).to_pylist()
    yield from unfinished_answer_rows(run_dir, finished, OBSERVED_COLUMNS)


def samples_not_sent(cfg: PipelineConfig) -> tuple[set[str], set[str]]:
    """(done, failed and kept): the samples the next generate run sends no request for, as the engine decides
    (`tasks.generate.rerun_policy.resend`, with the ledger's record of each deterministic failure)."""
    from tasks.generate.rerun_policy import RerunRules

    done: set[str] = set()
    failed: list[dict[str, Any]] = []
    for row in _response_rows(cfg.run_dir):
        if row["status"] == "done":
            done.add(row["sample_id"])
        elif row["status"] == "failed":
            failed.append(row)
    if not failed:
        return done, set()
    rules = RerunRules.of(cfg, SpendLedger.load(cfg.run_dir).deterministic)
    return done, {r["sample_id"] for r in failed if r["sample_id"] not in done and not rules.sends(r["sample_id"], r)}


def recorded_spend(run_dir: Path) -> SpendTotals:
    """The run directory's spend ledger: every attempt ever sent, retries, cut and killed requests included, as
    the budget of the next run counts it (done rows' `cost_usd` leave all of those out)."""
    return SpendLedger.load(run_dir).totals()


def observe(run_dir: Path) -> Observed:
    observed = Observed(run_dir)
    for row in _response_rows(run_dir):
        if row["status"] != "done" or row["completion_tokens"] is None:
            continue
        observed.completion_tokens.setdefault(row["dataset"], []).append(int(row["completion_tokens"]))
        if row["latency_s"] is not None:
            observed.latencies_s.append(float(row["latency_s"]))
    return observed


def _quantile(values: list[int] | list[float], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def _user_turn_prefixes(messages: list[Message], every_turn: bool) -> list[list[Message]]:
    """The conversations the endpoint is asked to answer for one sample (one per user turn for every_turn).
    For every_turn the history is the dataset's own answers here; the run sends the target's, so those prompt
    counts are approximate."""
    if not every_turn:
        return [messages]
    return [messages[: i + 1] for i, m in enumerate(messages) if m["role"] == "user"]


def estimate_run(
    cfg: PipelineConfig,
    tokenizer: PreTrainedTokenizerBase | None = None,
    observed_run_dir: Path | None = None,
    price_lookup: bool = True,
) -> RunEstimate:
    """Estimate what the run still has to buy. `observed_run_dir` (default: this run directory, when it holds
    finished samples) supplies the completion-length and latency distributions."""
    tokenizer = tokenizer or load_tokenizer(cfg.tokenizer)
    done, failed_kept = samples_not_sent(cfg)
    if observed_run_dir is not None and not (observed_run_dir / STAGE).is_dir():
        raise ConfigError(f"--observed {observed_run_dir}: not a run directory with responses/ (run it first)")
    observed = observe(observed_run_dir or cfg.run_dir)
    kwargs = cfg.tokenizer.chat_template_kwargs
    every_turn = cfg.sampling.regenerate == "every_turn"
    rows: list[DatasetEstimate] = []
    for ds in cfg.datasets:
        est = DatasetEstimate(ds.name)
        seen: set[str] = set()
        for _row_no, raw, parse_error in _raw_rows(ds):
            if ds.max_samples is not None and len(seen) >= ds.max_samples:
                break
            est.rows_read += 1
            try:
                if parse_error:
                    raise MalformedRow(parse_error)
                messages = normalize_row(raw, ds.shape)
            except MalformedRow:
                est.quarantined += 1
                continue
            sid = sample_id(ds.name, messages)
            if sid in seen:
                continue
            seen.add(sid)
            ids = [response_sample_id(sid, k) for k in range(cfg.sampling.samples_per_prompt)]
            pending = [rid for rid in ids if rid not in done and rid not in failed_kept]
            est.samples_total += len(ids)
            est.samples_done += sum(rid in done for rid in ids)
            est.samples_failed_kept += sum(rid in failed_kept for rid in ids)
            if not pending:
                continue
            prefixes = _user_turn_prefixes(messages, every_turn)
            tokens = sum(len(render_prompt_ids(tokenizer, prefix, kwargs)) for prefix in prefixes)
            est.requests += len(prefixes) * len(pending)
            est.prompt_tokens += tokens * len(pending)
        if not seen:
            what = f"all {est.quarantined} rows were quarantined" if est.quarantined else "it holds no rows"
            raise EmptyInputError(
                f"dataset {ds.name} ({ds.path}): {what}, no usable prompt; check the file and datasets[].shape"
            )
        _complete(est, observed, cfg.sampling.max_tokens)
        rows.append(est)
    latencies = observed.latencies_s
    spend = recorded_spend(cfg.run_dir)
    return RunEstimate(
        model=cfg.endpoint.model,
        datasets=rows,
        prices=resolve_prices(cfg.endpoint, lookup=price_lookup),
        max_in_flight=cfg.endpoint.max_in_flight,
        max_tokens=cfg.sampling.max_tokens,
        max_cost_usd=cfg.endpoint.max_cost_usd,
        spent_usd=spend.billed_usd,
        pending_usd=spend.pending_usd,
        observed_from=str(observed.run_dir) if observed.pooled() else None,
        latency_s_mean=statistics.fmean(latencies) if latencies else None,
        latency_s_p90=_quantile(latencies, 0.9) if latencies else None,
    )


def _complete(est: DatasetEstimate, observed: Observed, max_tokens: int) -> None:
    """Completion tokens: low = 10th percentile, expected = mean of what was observed (this dataset's, else all
    datasets'), capped at max_tokens; high = max_tokens for every request. Nothing observed: 1 .. max_tokens."""
    n = est.requests
    est.completion_tokens_high = n * max_tokens
    values = observed.completion_tokens.get(est.dataset)
    source = f"observed ({len(values)} samples in {observed.run_dir})" if values else ""
    if not values and observed.pooled():
        values = observed.pooled()
        source = f"observed ({len(values)} samples of other datasets in {observed.run_dir})"
    if values:
        est.completion_tokens_low = round(n * min(_quantile(values, LOW_QUANTILE), max_tokens))
        est.completion_tokens_expected = round(n * min(statistics.fmean(values), max_tokens))
        est.completion_source = source
    else:
        est.completion_tokens_low = n
        est.completion_tokens_expected = est.completion_tokens_high
        est.completion_source = "sampling.max_tokens (no observed run: expected = worst case)"


def over_budget(estimate: RunEstimate) -> str | None:
    """Why the cheapest outcome already crosses the cap, with what the run directory has spent; None if it fits.

    Spent means billed: attempts still pending count at their worst case in the budget, but generate settles them
    from the provider's records before it sends anything, and its budget stops at the cap whatever they turn out
    to cost. Counting them here at worst case refused every rerun after a `kill -9` (3 cut streams counted 30x
    what they cost) before that settlement could run."""
    low = estimate.cost_usd("low")
    cap = estimate.max_cost_usd
    if cap is None or low is None or not estimate.requests or estimate.spent_usd + low <= cap:
        return None
    return (
        f"the estimate's low end ${low:.4f} (+ ${estimate.spent_usd:.4f} already billed in the run directory's "
        f"spend ledger) exceeds endpoint.max_cost_usd=${cap:.4f} for {estimate.requests} requests to "
        f"{estimate.model}: raise endpoint.max_cost_usd, lower sampling.max_tokens or use fewer samples "
        "(datasets[].max_samples)"
    )


def check_budget(estimate: RunEstimate) -> None:
    """Refuse a run whose cheapest outcome already crosses the cap (`over_budget`)."""
    reason = over_budget(estimate)
    if reason is not None:
        raise EstimateOverBudgetError(reason)

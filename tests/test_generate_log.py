"""The generate task's log tells what happened: a progress line at a steady interval (sent, done, failed, retries
by reason, in flight, spend) from the real engine against the simulator, and one line per run event."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from endpoint_sim.responder import FailureRule
from endpoint_sim.server import SimulatorServer
from flows.generate_progress import LogProgressListener, log_line, logged_events
from tasks.generate import generate_parts
from tasks.generate.progress import ProgressSnapshot, RunEvent, emit_event
from tests.test_generate import MARKERS, make_cfg, refs, write_prompts
from tests.test_progress import RUNNING


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture()
def logger() -> logging.Logger:
    log = logging.getLogger("test-generate-log")
    log.handlers = [Lines()]
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def _lines(logger: logging.Logger) -> Lines:
    handler = logger.handlers[0]
    assert isinstance(handler, Lines)
    return handler


def test_progress_lines_from_the_real_engine_carry_retries_by_reason_and_failures(
    tmp_path: Path, sim: SimulatorServer, tokenizer_dir: Path, logger: logging.Logger
) -> None:
    sim.update_config(
        failures=(
            FailureRule(status=503, rate=0.3, attempts=1),
            FailureRule(kind="context_length", status=400, rate=0.2, attempts=None),
        )
    )
    write_prompts(tmp_path, 0, 12, "log")
    cfg = make_cfg(tmp_path, sim, tokenizer_dir, progress_every_s=0.05)
    snapshots: list[ProgressSnapshot] = []
    listeners = [LogProgressListener(logger, every_s=3600), snapshots.append]
    summary = generate_parts(cfg, refs(tmp_path, 1), MARKERS, listeners=listeners)
    total = summary.to_dict()["total"]
    assert total["retries_by_reason"].get("http_503", 0) > 0 and total["failures_by_reason"]["context_length"] > 0

    lines = _lines(logger).messages
    # The first snapshot and the final one, none in between within the interval (on a starved machine the
    # engine may not have published a snapshot before the final one: then the final line alone).
    assert snapshots and snapshots[-1].final
    assert len(lines) == min(2, len(snapshots)), [s.final for s in snapshots]
    last = lines[-1]
    assert last.startswith("generate 12/12 (100.0%)")
    assert f"sent {total['requests_sent']}" in last and f"done {total['done']}" in last
    assert f"failed {total['failed']} (context_length {total['failed']})" in last
    assert (
        f"retries {sum(total['retries_by_reason'].values())} (http_503 {total['retries_by_reason']['http_503']}" in last
    )
    assert "in flight 0/" in last and "billed $" in last and "pending $" in last


def test_the_line_names_an_outage_and_the_interval_is_steady(logger: logging.Logger) -> None:
    ticks = iter([0.0, 10.0, 31.0, 40.0, 41.0])
    listener = LogProgressListener(logger, every_s=30, clock=lambda: next(ticks))
    down = replace(RUNNING, endpoint_down_since_s=RUNNING.elapsed_s - 75, outages=2)
    for snapshot in (RUNNING, RUNNING, down, RUNNING):
        listener(snapshot)
    listener(replace(RUNNING, final=True))
    lines = _lines(logger).messages
    assert len(lines) == 3, "at 0 s, at 31 s (30 s later) and the final one"
    assert "endpoint down for 1m15s" in lines[1] and "outages 2" in lines[1]
    assert log_line(RUNNING) == lines[0]


def test_one_line_per_run_event_while_generate_runs(logger: logging.Logger) -> None:
    with logged_events(logger):
        emit_event(RunEvent("outage_start", "http://127.0.0.1:9/health refused: the endpoint is down", 12.0))
        emit_event(RunEvent("outage_end", "the endpoint answers again after 45 s", 57.0))
    emit_event(RunEvent("outage_start", "after the block: nobody listens", 99.0))
    records = _lines(logger).records
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]
    assert (
        records[0].getMessage()
        == "endpoint outage started at 12s: http://127.0.0.1:9/health refused: the endpoint is down"
    )
    assert records[1].getMessage().startswith("endpoint outage ended at 57s: the endpoint answers again")

"""An endpoint that goes away as a whole: its samples must not be marked failed. A short outage is ridden out
(retries past max_attempts do not count), a long one stops the run resumably with EndpointUnavailableError."""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from endpoint_sim.server import SimConfig, SimulatorServer
from tasks.common.errors import EndpointUnavailableError
from tasks.common.shards import PartRef
from tasks.generate.chunks import chunk_paths
from tasks.generate.engine import generate_parts
from tasks.generate.progress import ProgressSnapshot, heading, status_fields, status_line
from tests.test_generate_failures import (
    MARKERS,
    committed_chunks,
    make_cfg,
    question,
    responses,
    run,
    write_prompts,
)

SAMPLES = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_an_outage_longer_than_outage_abort_s_stops_the_run_without_failing_samples(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_prompts(tmp_path, [question("down", i) for i in range(SAMPLES)])
    cfg = make_cfg(
        tmp_path,
        f"http://127.0.0.1:{free_port()}",
        tokenizer_dir,
        "chat",
        max_attempts=2,
        outage_grace_s=0.0,
        outage_abort_s=1.0,
    )
    with pytest.raises(EndpointUnavailableError, match="no successful answer") as raised:
        run(cfg, tokenizer)
    assert "rerun to resume" in str(raised.value)
    assert committed_chunks(tmp_path) == {}, "an outage must not turn samples into failed rows"
    assert not PartRef(tmp_path, "responses", 0).is_done()


def test_a_short_outage_is_ridden_out_beyond_max_attempts(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """One attempt allowed per sample, and every first attempt refused: refused (never sent) attempts are free,
    at $0, and while the endpoint is down the breaker sends nothing but probes and one trial request."""
    port = free_port()
    write_prompts(tmp_path, [question("blip", i) for i in range(SAMPLES)])
    cfg = make_cfg(
        tmp_path,
        f"http://127.0.0.1:{port}",
        tokenizer_dir,
        "chat",
        max_attempts=1,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
        outage_grace_s=0.0,
        outage_abort_s=60.0,
        outage_probe_min_s=0.1,
        outage_probe_max_s=0.4,
    )
    server = SimulatorServer(tokenizer_dir, SimConfig(), port=port)
    comes_back = threading.Timer(1.0, server.start)
    comes_back.start()
    try:
        summary = run(cfg, tokenizer).total()
    finally:
        comes_back.join()
        server.stop()
    got = responses(tmp_path)
    assert summary["done"] == SAMPLES and {r["status"] for r in got.values()} == {"done"}
    assert max(r["attempts"] for r in got.values()) > cfg.endpoint.max_attempts, "refused attempts were not free"
    assert summary["retries_by_reason"].get("connect", 0) > 0 and summary["outages"] == 1
    spend = summary["spend"]
    assert spend["pending_attempts"] == 0 and spend["pending_usd"] == 0.0
    assert 0 < spend["unsent_attempts"] <= SAMPLES + 2, "the down endpoint was sent more than one try per sample"
    assert chunk_paths(tmp_path, 0) == []


def test_refused_connections_never_use_up_attempts_whatever_the_grace(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The old rule charged attempts before outage_grace_s: a down endpoint failed every sample in seconds."""
    write_prompts(tmp_path, [question("refused", i) for i in range(SAMPLES)])
    cfg = make_cfg(
        tmp_path,
        f"http://127.0.0.1:{free_port()}",
        tokenizer_dir,
        "chat",
        max_attempts=2,
        outage_grace_s=30.0,
        outage_abort_s=1.0,
    )
    with pytest.raises(EndpointUnavailableError):
        run(cfg, tokenizer)
    assert committed_chunks(tmp_path) == {}


# --- done-when 1 of issue 19, scaled down (the 60 s version is in test_outage_money.py, make test-long) ------------
def test_an_endpoint_killed_mid_run_is_not_hammered_and_costs_nothing_extra(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The endpoint goes away with 64 requests in flight and comes back 3 s later on the same port with its bill:
    no sample fails, the budget does not stop, at most the in-flight requests + 100 are sent while it is down
    (the breaker holds every sender; main's client sent one retry per sample every ~0.5 s), and the spend the
    run directory records equals the bill within 1% (main's client booked every refused retry at its worst
    case). The requests cut mid-stream are settled from their generation records. A request written in the
    instant the endpoint went down (still in the listen backlog, or read but not yet answered) saw no header
    and no chunk, so it has no generation id: only the key's account can say it cost nothing. Key settlement is
    on, as configs/run.yaml ships it; without it such a request stays pending at its worst case (CI once caught
    2 of 64 there, $0.0042 over the bill)."""
    import math
    import time

    from endpoint_sim.responder import Responder
    from tasks.generate.ledger import SpendLedger
    from tasks.generate.progress import RunEvent, add_event_listener

    down_s, samples = 3.0, 200
    sim_cfg = SimConfig(seed=19, latency_lognormal=(math.log(0.3), 0.3), reasoning_words=(5, 30), content_words=(5, 30))
    responder = Responder(tokenizer_dir, sim_cfg)
    bill = tmp_path / "bill.jsonl"
    first = SimulatorServer(tokenizer_dir, sim_cfg, responder=responder, billing_file=bill).start()
    write_prompts(tmp_path, [question("killed", i) for i in range(samples)])
    cfg = make_cfg(
        tmp_path,
        first.base_url,
        tokenizer_dir,
        "stream",
        max_in_flight=64,
        max_attempts=2,
        backoff_base_s=0.05,
        backoff_max_s=1.0,
        max_cost_usd=0.5,  # main's client booked ~400 refused retries at $0.002: a budget stop
        outage_probe_min_s=0.2,
        outage_probe_max_s=1.0,
        commit_every_samples=256,
        price_prompt_usd_per_mtok=sim_cfg.price_prompt_usd_per_mtok,
        price_completion_usd_per_mtok=sim_cfg.price_completion_usd_per_mtok,
        account_settlement="exclusive_key",
        account_settle_stable_s=0.2,
    )
    events: list[RunEvent] = []
    remove = add_event_listener(events.append)
    down: dict[str, float] = {}
    back: list[SimulatorServer] = []

    def outage() -> None:
        while first.stats(with_keys=False)["by_status"].get("200", 0) < 60:
            time.sleep(0.005)
        down["in_flight"] = first.stats(with_keys=False)["in_flight"]
        port = first.port
        down["at"] = time.time()
        first.stop()
        time.sleep(down_s)
        down["until"] = time.time()
        back.append(SimulatorServer(tokenizer_dir, sim_cfg, port=port, responder=responder, billing_file=bill).start())

    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    try:
        summary = run(cfg, None).total()  # type: ignore[arg-type]
    finally:
        thread.join(timeout=60)
        remove()
        first.stop()
        provider = back[0].billing()["total_usd"] if back else 0.0
        for server in back:
            server.stop()
    ledger = SpendLedger.load(tmp_path)
    during = [a for a in ledger.attempts.values() if a.sent_at and down["at"] <= a.sent_at <= down["until"]]
    totals = ledger.totals()
    print(
        f"in flight when it went down {down['in_flight']:.0f}, requests sent while down {len(during)}, "
        f"recorded ${totals.counted_usd:.5f} vs billed ${provider:.5f}, ledger {totals.to_dict()}"
    )
    assert down["in_flight"] >= 32, "the outage must catch the window full"
    assert summary["done"] == samples and summary["failed"] == 0 and summary["stopped"] is None
    assert len(during) <= down["in_flight"] + 100, "the down endpoint was hammered"
    assert totals.pending_attempts == 0, "a request cut by the outage is still at its worst case"
    assert totals.settled_by["generation"] >= down["in_flight"] - 16, "the cut streams were not settled by id"
    assert totals.counted_usd == pytest.approx(provider, rel=0.01), "recorded spend is not the bill"
    kinds = [e.kind for e in events]
    assert summary["outages"] == 1, [(e.kind, round(e.elapsed_s, 2), e.message) for e in events]
    assert kinds.count("outage_start") == 1 and kinds.count("outage_end") == 1 and "settled" in kinds


# --- the whole endpoint down mid-run for 45 s, longer than the old grace (issue: "outages fail no sample") --------
# The old rule charged attempts for the first outage_grace_s of silence (30 s, still the field's default though
# unused), so an outage of 45 s failed every sample in flight. One test takes two endpoints down for the real
# 45 s, one under the CLI and one under a Prefect run, at the same time: the cost is one outage of wall time.
OUTAGE_S = 45.0
OUTAGE_ABORT_S = 300.0  # comfortably above the outage: the run must ride it out, not stop
MAX_ATTEMPTS = 3  # a request failing in the instant its endpoint comes back may use up one (README: outages)


def _outage_sim() -> SimConfig:
    import math

    return SimConfig(seed=9, latency_lognormal=(math.log(0.1), 0.2))


class Outage(threading.Thread):
    """Stops `first` once it has received `after_requests` requests, and starts a fresh simulator on the same
    port OUTAGE_S later (`back`). `down_at` / `up_at`: monotonic times, for the report. `close` cuts a pending
    outage short (a run that failed early is not kept waiting) and stops both servers."""

    def __init__(self, first: SimulatorServer, model_dir: Path, after_requests: int) -> None:
        super().__init__(daemon=True)
        self.first, self.model_dir, self.after_requests = first, model_dir, after_requests
        self.back: SimulatorServer | None = None
        self.error: BaseException | None = None
        self.down_at = self.up_at = 0.0
        self._cancel = threading.Event()

    def run(self) -> None:
        import time

        try:
            deadline = time.monotonic() + 300
            while self.first.stats(with_keys=False)["total_requests"] < self.after_requests:
                assert time.monotonic() < deadline, "the run never reached the outage point"
                if self._cancel.wait(0.01):
                    return
            port = self.first.port
            self.first.stop()
            self.down_at = time.monotonic()
            self._cancel.wait(OUTAGE_S)
            self.back = SimulatorServer(self.model_dir, _outage_sim(), port=port).start()
            self.up_at = time.monotonic()
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self._cancel.set()
        self.join(timeout=120)
        self.first.stop()
        if self.back is not None:
            self.back.stop()


@pytest.mark.slow  # 45 s of real time: `make test-long`, which CI runs after `make test`
@pytest.mark.usefixtures("prefect_harness")
def test_a_45_s_outage_fails_no_sample_under_the_cli_and_under_a_prefect_run(
    tmp_path: Path, tokenizer_dir: Path, tiny_model_dir: Path
) -> None:
    from flows.cli import demo_config_path
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from tasks.common.config import EndpointConfig
    from tasks.common.shards import done_parts, read_part
    from tests.test_generate_money import cli, write_config, write_dataset

    old_grace_s = EndpointConfig.model_fields["outage_grace_s"].default
    assert old_grace_s < OUTAGE_S, "the outage must be longer than the old rule's grace"

    # The CLI: `eagle3-datagen generate` in its own process, 60 samples, default outage_grace_s.
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    data = cli_dir / "prompts.jsonl"
    write_dataset(data, 60, "outage")
    cli_sim = SimulatorServer(tokenizer_dir, _outage_sim()).start()
    config = write_config(
        cli_dir,
        cli_sim,
        tokenizer_dir,
        data,
        max_in_flight=4,
        max_attempts=MAX_ATTEMPTS,
        backoff_base_s=0.05,
        backoff_max_s=1.0,
        outage_abort_s=OUTAGE_ABORT_S,
        max_cost_usd=None,
    )
    # The Prefect run: the whole pipeline in this process (demo config, 80 samples, extraction off).
    flow_sim = SimulatorServer(tiny_model_dir, _outage_sim()).start()
    overrides = {
        "run_dir": str(tmp_path / "flow"),
        "endpoint.base_url": flow_sim.base_url,
        "tokenizer.path": str(tiny_model_dir),
        "extract.enabled": False,
        "endpoint.max_in_flight": 4,
        "endpoint.max_attempts": MAX_ATTEMPTS,
        "endpoint.backoff_base_s": 0.05,
        "endpoint.backoff_max_s": 1.0,
        "endpoint.outage_abort_s": OUTAGE_ABORT_S,
    }

    outages = [Outage(cli_sim, tokenizer_dir, after_requests=12), Outage(flow_sim, tiny_model_dir, after_requests=12)]
    for outage in outages:
        outage.start()
    proc = cli(config, cli_dir / "generate.log")
    try:
        state = pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides), return_state=True)
        code = proc.wait(timeout=OUTAGE_S + 400)
    finally:
        if proc.poll() is None:
            proc.kill()
        for outage in outages:
            outage.close()
    for outage in outages:
        assert outage.error is None, outage.error
        assert outage.down_at > 0 and outage.up_at - outage.down_at >= OUTAGE_S, "the outage was cut short"
    (cli_out, flow_out), start = outages, min(o.down_at for o in outages)
    print(  # -s shows how far the two outages overlapped (no assertion: that is the machine's timing)
        f"outages: CLI endpoint down {cli_out.down_at - start:.1f}-{cli_out.up_at - start:.1f} s, "
        f"Prefect run's endpoint down {flow_out.down_at - start:.1f}-{flow_out.up_at - start:.1f} s"
    )

    log = (cli_dir / "generate.log").read_text()
    assert code == 0, log
    assert state.is_completed(), (state.name, state.message)
    # The outage hit both runs: the circuit breaker opened (so no sample spent attempts on the dead host).
    assert "endpoint outage started" in log and "endpoint outage ended" in log, log
    assert state.result()["generate"]["total"]["outages"] >= 1, "the Prefect run saw no outage"
    for what, run_dir, samples in (("CLI", cli_dir / "run", 60), ("Prefect run", tmp_path / "flow", 80)):
        rows = [row for ref in done_parts(run_dir, "responses") for row in read_part(ref).to_pylist()]
        assert len(rows) == samples, run_dir
        assert {r["status"] for r in rows} == {"done"}, f"{run_dir}: the outage failed samples"
        attempts = max(r["attempts"] for r in rows)
        assert attempts <= MAX_ATTEMPTS, f"{run_dir}: a sample spent {attempts} attempts (the outage used some)"
        print(f"{what}: {samples} samples done, none failed, most attempts of one sample {attempts}")


def test_cli_against_a_port_where_nothing_ever_listens_exits_non_zero_without_failed_samples(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate` through the console script's `main`, in this process (the 45 s outage test runs it as one)."""
    from tests.conftest import run_main
    from tests.test_generate_money import write_config, write_dataset

    data = tmp_path / "prompts.jsonl"
    write_dataset(data, 12, "nobody")

    class Nowhere:
        base_url = f"http://127.0.0.1:{free_port()}"

    config = write_config(tmp_path, Nowhere, tokenizer_dir, data, outage_abort_s=2.0)  # type: ignore[arg-type]
    done = run_main(capsys, "generate", str(config), "--no-progress")
    assert done.returncode != 0, done.stdout + done.stderr
    assert "outage_abort_s" in done.stderr and "Traceback" not in done.stdout + done.stderr
    assert not list((tmp_path / "run" / "responses").rglob("*.parquet")), "a sample got a row"


def _final(snapshots: list[ProgressSnapshot]) -> ProgressSnapshot:
    finals = [s for s in snapshots if s.final]
    assert len(finals) == 1, finals
    return finals[0]


def test_a_run_cancelled_mid_way_ends_with_a_snapshot_saying_so_not_finished(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Cancelling a flow run (the UI's Cancel: state CANCELLING, then the worker's SIGTERM, which Prefect's engine
    turns into a TerminationSignal) left the card "generate: final ... ETA finished in 17s" at 16% (a UI probe).
    The same signal here, mid-run: the final snapshot says where it stopped and why."""
    from prefect.exceptions import TerminationSignal

    from flows.generate_progress import log_line, status_markdown

    def terminate(signum: int, frame: object) -> None:
        raise TerminationSignal(signal=signum)

    write_prompts(tmp_path, [question("cancel", i) for i in range(40)])
    snapshots: list[ProgressSnapshot] = []
    with SimulatorServer(tokenizer_dir, SimConfig(latency_s=0.3)) as sim:
        cfg = make_cfg(tmp_path, sim.base_url, tokenizer_dir, "chat", max_in_flight=2)
        previous = signal.signal(signal.SIGTERM, terminate)
        timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
        try:
            timer.start()
            with pytest.raises(TerminationSignal):
                generate_parts(cfg, [PartRef(tmp_path, "prompts", 0)], MARKERS, listeners=[snapshots.append])
        finally:
            timer.cancel()
            signal.signal(signal.SIGTERM, previous)
    final = _final(snapshots)
    assert final.stopped == "cancelled" and 0 < final.finished < final.total == 40
    where = f"{final.finished}/40"
    assert heading(final) == f"stopped at {where}: cancelled"
    assert status_markdown(final).startswith(f"**generate: stopped at {where}: cancelled**")
    eta = dict(status_fields(final))["ETA"]
    assert eta.startswith("none: stopped after") and eta.endswith("(cancelled)") and "finished" not in eta
    assert "finished" not in status_line(final) and log_line(final).endswith(f"stopped at {where}: cancelled")


def test_an_outage_abort_ends_with_a_snapshot_saying_it_aborted(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    write_prompts(tmp_path, [question("down", i) for i in range(SAMPLES)])
    cfg = make_cfg(
        tmp_path, f"http://127.0.0.1:{free_port()}", tokenizer_dir, "chat", outage_grace_s=0.0, outage_abort_s=1.0
    )
    snapshots: list[ProgressSnapshot] = []
    with pytest.raises(EndpointUnavailableError):
        generate_parts(cfg, [PartRef(tmp_path, "prompts", 0)], MARKERS, listeners=[snapshots.append])
    final = _final(snapshots)
    assert final.stopped is not None and final.stopped.startswith("aborted: the endpoint did not answer")
    assert heading(final).startswith(f"stopped at 0/{SAMPLES}: aborted") and "finished" not in status_line(final)


def test_a_run_that_ends_at_the_budget_cap_with_samples_left_is_not_called_final() -> None:
    from tests.test_progress import RUNNING

    capped = replace(RUNNING, budget_stopped=True, final=True)
    assert heading(capped) == "stopped at 200/1,000: the budget cap"
    assert heading(replace(RUNNING, done=990, failed=10, final=True)) == "final"
    assert heading(RUNNING) == "in progress"


def test_a_burst_of_503s_while_the_liveness_probe_answers_fails_no_sample(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Every chat completion answered 503 for 60 s while GET /v1/models answered 200 (a provider-side burst on
    OpenRouter looks like this): each probe said up, so each 503 used up an attempt and 858 of 2,000 samples
    failed. Scaled down: a 2 s burst at three attempts a sample; the breaker opens on three failures in a row,
    the failures while it is open are free, and one trial request every outage_probe_min_s (each failed one
    uses up its own sample's attempt: at most 8 over 16 samples) rides the burst out."""
    from endpoint_sim.responder import FailureRule

    write_prompts(tmp_path, [question("burst", i) for i in range(16)])
    with SimulatorServer(tokenizer_dir, SimConfig(failures=(FailureRule(status=503, rate=1.0, attempts=None),))) as sim:
        cfg = make_cfg(
            tmp_path,
            sim.base_url,
            tokenizer_dir,
            "stream",
            max_attempts=3,
            outage_probe_min_s=0.25,
            outage_probe_max_s=0.5,
            outage_abort_s=60.0,
        )
        burst_ends = threading.Timer(2.0, lambda: sim.update_config(failures=()))
        burst_ends.start()
        try:
            summary = run(cfg, tokenizer).total()
        finally:
            burst_ends.join()
    got = responses(tmp_path)
    assert {r["status"] for r in got.values()} == {"done"}, summary["failures_by_reason"]
    assert summary["outages"] >= 1 and summary["retries_by_reason"].get("http_503", 0) > 0

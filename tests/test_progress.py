"""Generate progress: snapshot formatting, the terminal display (Live and line mode), the per-dataset summary
of responses on disk (parts + chunks), and the Prefect artifacts published from a thread outside the run."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from rich.console import Console

from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, TokenizerConfig
from tasks.common.schemas import PROMPTS, RESPONSES
from tasks.common.shards import PartRef, stage_metadata, write_parquet_atomic, write_part
from tasks.generate.dataset_summary import dataset_rows
from tasks.generate.ledger import LedgerWriter
from tasks.generate.progress import ProgressSnapshot, emit, format_counts, format_usd, status_fields, status_line
from tasks.generate.progress_display import ProgressDisplay, render, show_progress

RUNNING = ProgressSnapshot(
    elapsed_s=100.0,
    total=1000,
    done=180,
    failed=20,
    in_flight=50,
    window=64,
    requests_sent=250,
    prompt_tokens=40_000,
    completion_tokens=120_000,
    cost_usd=2.0,
    prior_cost_usd=1.0,
    reserved_usd=0.5,
    max_cost_usd=10.0,
    budget_stopped=False,
    final=False,
    failures_by_reason={"timeout": 5, "http_500": 12, "context_length": 1, "length": 2},
    retries_by_reason={"http_503": 20, "timeout": 10},
)


def fields(snapshot: ProgressSnapshot) -> dict[str, str]:
    return dict(status_fields(snapshot))


def clock(*times: float) -> Callable[[], float]:
    return iter(times).__next__


def test_status_fields_project_cost_eta_and_budget() -> None:
    f = fields(RUNNING)
    assert f["samples"] == "200 / 1,000 (20.0%): 180 done, 20 failed"
    assert f["in flight"] == "50 (window 64)"
    assert f["throughput"] == "2.5 req/s, 1,200 completion tok/s"
    assert f["cost"] == "$2.00 this run, $3.00 run-dir total"
    # $3 spent so far + $2 / 200 finished samples * 800 remaining
    assert f["projected"] == "$11.00 run-dir total, over the cap: the run will stop at the cap"
    assert f["budget"] == "cap $10.00: 30% spent, $0.5000 reserved, $6.50 left"
    assert f["ETA"] == "6m40s"  # 800 remaining at 2 samples/s
    assert f["failures"] == "http_500 12, timeout 5, length 2, +1 more"


def test_status_fields_at_the_start_without_cap_after_a_budget_stop_and_at_the_end() -> None:
    start = replace(RUNNING, done=0, failed=0, cost_usd=0.0, max_cost_usd=None, failures_by_reason={})
    f = fields(start)
    assert (f["projected"], f["ETA"], f["failures"]) == ("-", "-", "-")
    assert f["budget"] == "no cap, $0.5000 reserved in flight"

    stopped = replace(RUNNING, budget_stopped=True, final=True, reserved_usd=0.0)
    f = fields(stopped)
    assert f["ETA"] == "stopped at the budget cap"
    assert f["budget"].endswith("$7.00 left (STOPPED)")

    done = replace(RUNNING, done=990, failed=10, final=True, elapsed_s=3725.0, max_cost_usd=None)
    f = fields(done)
    assert f["ETA"] == "finished in 1h02m"
    assert f["projected"] == "$3.00 run-dir total"


def test_status_line_is_one_compact_line() -> None:
    line = status_line(RUNNING)
    assert "\n" not in line
    assert line.startswith("generate 200/1,000 (20.0%) | done 180 failed 20 | in flight 50/64 |")
    assert "$2.00 run ($3.00 total, cap $10.00)" in line and "ETA 6m40s" in line
    assert format_counts({"b": 2, "a": 2, "c": 0}) == "a 2, b 2"


def test_render_draws_bar_and_fields() -> None:
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    console.print(render(RUNNING))
    text = console.export_text()
    assert " 20.0%  generate" in text
    assert "projected" in text and "$11.00 run-dir total" in text
    assert "http_500 12" in text


def test_without_a_terminal_a_line_goes_to_stderr_at_most_every_ten_seconds() -> None:
    out, lines = io.StringIO(), io.StringIO()
    display = ProgressDisplay(Console(file=out), line_stream=lines, clock=clock(0.0, 4.0, 9.9, 10.5, 12.0))
    assert not display.live_mode
    for done in (10, 20, 30, 40):
        display(replace(RUNNING, done=done, failed=0))
    display(replace(RUNNING, final=True))
    printed = lines.getvalue().splitlines()
    assert [p.split(" | ")[0] for p in printed] == [
        "generate 10/1,000 (1.0%)",
        "generate 40/1,000 (4.0%)",
        "generate 200/1,000 (20.0%)",
    ]
    assert out.getvalue() == "", "no Live output may reach a non-terminal stdout"


def test_on_a_terminal_live_starts_with_the_first_snapshot_and_stops_with_the_final_one() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    with show_progress(console=console) as display:
        assert display is not None and display.live_mode
        emit(replace(RUNNING, done=100, failed=0))
        emit(replace(RUNNING, done=980, failed=20, final=True))
        assert display.latest is not None and display.latest.final
        live_output = out.getvalue()
        emit(replace(RUNNING, done=5))
        assert display.latest.done == 5  # a second run in the same block (a task retry) is shown too
    assert "10.0%" in live_output and "100.0%" in live_output and "finished in" in live_output
    later = replace(RUNNING, done=7)
    emit(later)
    assert display.latest.done == 5, "the listener must be unregistered when the block ends"


def test_show_progress_disabled_registers_nothing() -> None:
    with show_progress(enabled=False) as display:
        assert display is None


# --- per-dataset summary of responses on disk -------------------------------------------------------------


def response(sample_id: str, dataset: str, status: str, **values: Any) -> dict[str, Any]:
    row: dict[str, Any] = {name: None for name in RESPONSES.names}
    row.update({"sample_id": sample_id, "dataset": dataset, "status": status, "attempts": 1, **values})
    return row


def write_chunk(run_dir: Path, part: int, index: int, rows: list[dict[str, Any]]) -> None:
    path = run_dir / "responses" / "_chunks" / f"part-{part:05d}" / f"chunk-{index:06d}.parquet"
    write_parquet_atomic(path, pa.Table.from_pylist(rows, schema=RESPONSES), stage_metadata("responses", {}))


def write_prompts(run_dir: Path, part: int, dataset: str, ids: list[str]) -> None:
    rows = [
        {
            "sample_id": sid,
            "dataset": dataset,
            "source_file": "x.jsonl",
            "source_row": i,
            "messages": [{"role": "user", "content": sid}],
            "prompt_id": sid,
            "sample_index": 0,
        }
        for i, sid in enumerate(ids)
    ]
    write_part(PartRef(run_dir, "prompts", part), pa.Table.from_pylist(rows, schema=PROMPTS), provenance={})


def tokens(p: int, c: int, r: int) -> dict[str, int]:
    return {"prompt_tokens": p, "completion_tokens": c, "reasoning_tokens": r}


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """Part 0 (alpha) finished; part 1 (beta) still in progress: two chunks, two samples without a row yet."""
    write_prompts(tmp_path, 0, "alpha", ["a0", "a1", "a2"])
    finished = [
        response(
            "a0",
            "alpha",
            "done",
            cost_usd=0.01,
            billed_cost_usd=0.011,
            provider="A",
            quantization="fp8",
            **tokens(10, 100, 40),
        ),
        response("a1", "alpha", "done", cost_usd=0.02, provider="A", quantization="fp8", **tokens(20, 200, 80)),
        response("a2", "alpha", "failed", failure_reason="http_500", attempts=6),
    ]
    write_part(PartRef(tmp_path, "responses", 0), pa.Table.from_pylist(finished, schema=RESPONSES), provenance={})

    write_prompts(tmp_path, 1, "beta", ["b0", "b1", "b2", "b3", "b4"])
    write_chunk(
        tmp_path,
        1,
        0,
        [
            response("b0", "beta", "failed", failure_reason="timeout"),
            response("b1", "beta", "done", cost_usd=0.5, provider="B", quantization="bf16", **tokens(5, 50, 0)),
            response("b2", "beta", "failed", failure_reason="http_500"),
        ],
    )
    write_chunk(
        tmp_path,
        1,
        1,
        [
            response("b0", "beta", "done", cost_usd=0.25, provider="A", **tokens(5, 25, 0)),
            response("b1", "beta", "failed", failure_reason="timeout"),
            response("b2", "beta", "failed", failure_reason="length", cost_usd=0.125, provider="B", **tokens(5, 99, 0)),
            response("stale", "beta", "done", cost_usd=100.0),
        ],
    )
    (tmp_path / "responses" / "_chunks" / "part-00001" / ".chunk-000002.parquet.1234.tmp").write_bytes(b"torn")
    # The spend ledger is where money is read from: every attempt, replaced rows' and unknown outcomes' too.
    ledger = LedgerWriter(tmp_path, group_commit_s=0.2)
    for sid, dataset, part, cost in [
        ("a0", "alpha", 0, 0.01),
        ("a1", "alpha", 0, 0.02),
        ("a2", "alpha", 0, 0.0),
        ("a2", "alpha", 0, None),  # outcome never seen: counts at its worst case, 0.004
        ("b0", "beta", 1, None),  # the timeout of the row that was replaced: worst case 0.004
        ("b0", "beta", 1, 0.25),
        ("b1", "beta", 1, 0.5),
        ("b2", "beta", 1, 0.125),
    ]:
        uid = ledger.sent(sid, dataset, part, 0.004)
        ledger.ended(uid, "pending" if cost is None else "answered", cost, None, None)
    ledger.close()
    return tmp_path


def test_dataset_rows_merge_finished_parts_and_chunks(run_dir: Path) -> None:
    alpha, beta = dataset_rows(run_dir, [0, 1])
    assert alpha == {
        "dataset": "alpha",
        "samples": 3,
        "done": 2,
        "failed": 1,
        "pending": 0,
        "failures": "http_500 1",
        "failure_class": "transient 1",
        "prompt_tokens": 30,
        "completion_tokens": 300,
        "reasoning_tokens": 120,
        "billed_usd": pytest.approx(0.03),
        "pending_usd": pytest.approx(0.004),
        "billed_cost_usd": pytest.approx(0.011),
        "providers": "A 100%",
        "quantizations": "fp8 100%",
    }
    # b0: a later done row wins over a failure; b1: a done row is never replaced; b2: the later failure wins;
    # "stale" is not in the prompts part; b3 and b4 have no row yet.
    assert beta == {
        "dataset": "beta",
        "samples": 5,
        "done": 2,
        "failed": 1,
        "pending": 2,
        "failures": "length 1",
        "failure_class": "deterministic 1",
        "prompt_tokens": 15,
        "completion_tokens": 174,
        "reasoning_tokens": 0,
        "billed_usd": pytest.approx(0.875),
        "pending_usd": pytest.approx(0.004),
        "billed_cost_usd": None,
        "providers": "B 67%, A 33%",
        "quantizations": "bf16 100%",
    }


def test_dataset_rows_of_a_part_not_started_and_of_no_parts(tmp_path: Path) -> None:
    write_prompts(tmp_path, 0, "gamma", ["g0", "g1"])
    assert dataset_rows(tmp_path, [0]) == [
        {
            "dataset": "gamma",
            "samples": 2,
            "done": 0,
            "failed": 0,
            "pending": 2,
            "failures": "-",
            "failure_class": "-",
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "reasoning_tokens": 0,
            "billed_usd": 0.0,
            "pending_usd": 0.0,
            "billed_cost_usd": None,
            "providers": "-",
            "quantizations": "-",
        }
    ]
    assert dataset_rows(tmp_path, []) == []


# --- Prefect artifacts -------------------------------------------------------------------------------------


def _artifacts(flow_run_id: Any, key: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return list(
            client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])
                )
            )
        )


@pytest.fixture()
def cfg(run_dir: Path) -> PipelineConfig:
    return PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="alpha", path=run_dir)],
        endpoint=EndpointConfig(model="m"),
        tokenizer=TokenizerConfig(path=run_dir),
    )


@pytest.mark.usefixtures("prefect_harness")
def test_prefect_listener_keeps_one_card_current_from_a_foreign_thread_throttled(cfg: PipelineConfig) -> None:
    """One `generate-progress` card per run, updated in place (its description is the status table), never a
    new card per snapshot: two cards of one key read as two runs in the UI."""
    from prefect import flow, task

    from flows.generate_progress import PrefectProgressListener, publish_generate_summary

    snapshots = [
        replace(RUNNING, done=100, failed=0, elapsed_s=1.0),
        replace(RUNNING, done=150, failed=0, elapsed_s=6.0),  # within 5 s of the last publish: skipped
        replace(RUNNING, done=300, failed=0, elapsed_s=21.0, retries_by_reason={"http_503": 4}),
        replace(RUNNING, done=990, failed=10, elapsed_s=22.0, final=True),  # always published
    ]
    published: list[int] = []

    class Recording(PrefectProgressListener):
        def _publish(self, client: Any, snapshot: ProgressSnapshot) -> None:
            published.append(snapshot.done)
            super()._publish(client, snapshot)

    @task
    def generate_like() -> dict[str, Any]:
        listener = Recording(clock=clock(0.0, 2.0, 20.0, 21.0))
        errors: list[BaseException] = []

        def engine_thread() -> None:
            try:
                for snapshot in snapshots:
                    listener(snapshot)
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join()
        assert not errors, errors
        rows = publish_generate_summary(cfg, [0, 1])
        return {"progress_id": listener.progress_id, "task_run_id": listener.task_run_id, "rows": rows}

    @flow
    def progress_flow() -> dict[str, Any]:
        return generate_like()

    state = progress_flow(return_state=True)
    assert state.is_completed(), state.message
    out = state.result()
    flow_run_id = state.state_details.flow_run_id
    assert published == [100, 300, 990]

    (progress,) = _artifacts(flow_run_id, "generate-progress")
    assert progress.id == out["progress_id"] and progress.task_run_id == out["task_run_id"]
    assert progress.type == "progress" and progress.data == pytest.approx(100.0)
    description = progress.description or ""
    assert description.startswith("**generate: final**") and "| samples | 1,000 / 1,000 (100.0%)" in description
    assert "\\n" not in description
    assert _artifacts(flow_run_id, "generate-status") == [], "no second card"

    from flows.artifact_keys import run_key

    (table,) = _artifacts(flow_run_id, run_key("generate-summary", cfg.run_dir))
    assert table.type == "table"
    assert [r["dataset"] for r in out["rows"]] == ["alpha", "beta"]
    assert '"pending": 2' in str(table.data) and '"failures": "length 1"' in str(table.data)


def test_prefect_listener_needs_a_run() -> None:
    from flows.generate_progress import PrefectProgressListener

    with pytest.raises(RuntimeError, match="inside a Prefect flow or task run"):
        PrefectProgressListener()


def test_a_sum_in_another_order_prints_the_same_amount() -> None:
    """0.03525 summed in two orders printed $0.0353 in `run` and $0.0352 in `status`."""
    assert format_usd(0.0352499999999) == format_usd(0.03525000001) == format_usd(0.03525) == "$0.0353"
    assert format_usd(1234.565) == "$1,234.57" and format_usd(None) == "-"


@pytest.mark.usefixtures("prefect_harness")
def test_a_retried_run_does_not_keep_an_earlier_attempts_card_in_progress(cfg: PipelineConfig) -> None:
    """A crashed run retried from the UI kept its first attempt's card at 50% "in progress" on a run that then
    completed (nothing was left to send). A later attempt's card marks the earlier one superseded; an attempt
    that finds nothing to send marks it final, at 100%."""
    from prefect import flow, task

    from flows.generate_progress import SUPERSEDED, PrefectProgressListener, retire_progress_of_this_run

    @task
    def attempt(done: int) -> Any:
        listener = PrefectProgressListener()
        listener(replace(RUNNING, done=done, failed=0, elapsed_s=1.0))
        return listener.progress_id

    @flow
    def retried() -> tuple[Any, Any, int]:
        first, second = attempt(500), attempt(700)
        return (
            first,
            second,
            retire_progress_of_this_run("generate-progress", "generate: final (nothing left to send)", 100.0),
        )

    state = retried(return_state=True)
    first, second, retired = state.result()
    cards = {a.id: a for a in _artifacts(state.state_details.flow_run_id, "generate-progress")}
    assert set(cards) == {first, second} and retired == 1
    assert (cards[first].description or "").startswith(
        f"**{SUPERSEDED}**\n\n**generate: stopped: an earlier attempt of this flow run**"
    )
    assert (cards[second].description or "").startswith("**generate: final (nothing left to send)**")
    assert cards[first].data == pytest.approx(50.0) and cards[second].data == pytest.approx(100.0)


@pytest.mark.usefixtures("prefect_harness")
def test_a_new_trigger_retires_the_card_of_a_run_that_ended_before_its_generate_finished() -> None:
    """A run crashed (or failed) mid-generate and replaced by a new trigger, not a Retry, kept its card "in
    progress" at the percent it reached for good. The next run's card tells it which run took over; a run still
    running (here the parent of the one after it) keeps its card."""
    from uuid import uuid4

    from prefect import flow

    from flows.generate_progress import PrefectProgressListener

    key = f"generate-progress-{uuid4().hex[:8]}"

    def card(done: int) -> Any:
        listener = PrefectProgressListener(key=key)
        listener(replace(RUNNING, done=done, failed=0, elapsed_s=1.0))
        return listener.progress_id

    @flow
    def ended_mid_generate() -> None:
        card(500)
        raise RuntimeError("worker lost")

    @flow
    def new_trigger() -> Any:
        return card(700)

    @flow
    def still_running() -> Any:
        card(300)
        return new_trigger(return_state=True)

    ended = ended_mid_generate(return_state=True)
    assert ended.is_failed()
    parent: Any = still_running(return_state=True)
    child = parent.result()
    ended_card = _artifacts(ended.state_details.flow_run_id, key)
    parent_card = _artifacts(parent.state_details.flow_run_id, key)
    child_card = _artifacts(child.state_details.flow_run_id, key)
    assert len(ended_card) == len(parent_card) == len(child_card) == 1
    assert (ended_card[0].description or "").startswith(
        "**this run ended Failed before its generate finished; flow run "
    ) and f"({parent.state_details.flow_run_id}) took over**\n\n**generate: stopped: its run ended Failed**" in (
        ended_card[0].description or ""
    )
    # Below the note, nothing reads as if the run were still going (a UI probe: "in progress", "ETA 36s",
    # "in flight 1", "$0.0103 reserved" under the note).
    retired = ended_card[0].description or ""
    assert "in progress" not in retired and "| ETA | none: stopped (its run ended Failed) |" in retired
    assert "| in flight | none: its attempt ended |" in retired and "nothing reserved" in retired
    assert "$0.50 reserved" not in retired and "$0.5000 reserved" not in retired
    assert ended_card[0].data == pytest.approx(50.0)
    assert (parent_card[0].description or "").startswith("**generate: in progress**")
    assert (child_card[0].description or "").startswith("**generate: in progress**")


def test_the_retries_count_is_the_sum_of_retries_by_reason_and_attempts_are_counted_in_words() -> None:
    """A live card read "10 retries" beside "retries by reason: http_503 12" (one counted the retries of recorded
    samples, the other those of samples still in flight too), and "pending over 1 attempts"."""
    live = replace(RUNNING, retries_by_reason={"http_503": 12})
    assert live.retries == 12 and fields(live)["requests"] == "250 sent, 12 retries"
    one = replace(RUNNING, pending_usd=0.01, pending_attempts=1)
    assert "pending over 1 attempt (worst case" in fields(one)["cost"]
    assert "pending over 2 attempts (" in fields(replace(one, pending_attempts=2))["cost"]

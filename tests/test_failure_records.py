"""The failed-sample record every surface shows, the failed-samples artifact's rows, and the failed-responses
gates: what a rerun retries is gated apart from what it cannot fix, and each message says which is which."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from flows.failed_samples import COLUMNS, artifact_key, publish_failed_samples, table_rows
from tasks.common.config import ValidationConfig
from tasks.common.failures import FAILURE_COLUMNS, FailureRecord, rerun_action
from tasks.status.report import rerun_summary
from tasks.validate.failure_gates import FailedResponses, failed_gate_violations, rerun_may_pass


def _stats(failures: dict[str, str], responses: int = 48) -> dict[str, object]:
    tally = FailedResponses()
    for sid, reason in failures.items():
        tally.add(sid, "failed", reason)
    for i in range(responses - len(failures)):
        tally.add(f"ok-{i}", "done", None)
    return {"responses": tally.responses, **tally.to_dict()}


def test_a_record_has_the_shared_columns_one_line_of_error_and_the_rerun_outlook() -> None:
    error = "HTTP 500:\n  upstream\tfailed " + "x" * 400
    record = FailureRecord(
        "s1", "B1", "responses", "http_500", "transient", 4, error, rerun_action("responses", "transient", "http_500")
    )
    row = record.to_dict()
    assert tuple(row) == FAILURE_COLUMNS
    assert row["last_error"].startswith("HTTP 500: upstream failed x") and "\n" not in row["last_error"]
    assert len(row["last_error"]) == 300 and row["last_error"].endswith("...")
    assert row["rerun"] == "retried by the next run"
    assert rerun_action("responses", "deterministic", "context_length").startswith("never as sent")
    assert "sampling.max_tokens" in rerun_action("responses", "deterministic", "length")
    # Under a run that had retry_failed: all, a plain Run or the nightly rerun (which do not carry the override)
    # would not resend: the words say which run does; a prompt over the context is refused again as sent.
    resent = rerun_action("responses", "deterministic", "http_400", retry_failed="all")
    assert resent == "resent only by a run with endpoint.retry_failed: all (as this one had)"
    assert rerun_action("responses", "deterministic", "context_length", retry_failed="all").startswith("never as sent")
    assert rerun_action("prepare", "quarantined", "").startswith("never: fix the row")


def test_artifact_rows_show_every_column_and_name_quarantined_rows() -> None:
    assert set(COLUMNS) == set(FAILURE_COLUMNS) and COLUMNS[:4] == ("sample_id", "reason", "class", "rerun")
    failed = FailureRecord(
        "abc", "B1", "validation", "validation: tool_call", "validation", None, "x", "never"
    ).to_dict()
    quarantined = {**FailureRecord(None, "B1", "prepare", "bad JSON", "quarantined", None, None, "never").to_dict()}
    quarantined |= {"source_file": "/data/b1.jsonl", "source_row": 17}
    rows = table_rows([failed, quarantined])
    assert rows[0]["attempts"] == "-" and rows[0]["sample_id"] == "abc"
    assert rows[1]["sample_id"] == "row 17 of b1.jsonl"
    assert (
        artifact_key("B1", "runs/run") == "failed-samples-b1-run"
        and artifact_key("Chat Set/2024!", "/data/Nightly Kimi") == "failed-samples-chat-set-2024-nightly-kimi"
    )


def test_deterministic_failures_have_their_own_gate_and_a_message_that_names_samples_and_setting() -> None:
    vcfg = ValidationConfig()
    three = {f"ctx-{i}": "context_length" for i in range(3)}
    assert failed_gate_violations("B1", _stats(three), vcfg) == [], "3/48 is within the default 0.10"

    eight = {f"ctx-{i}": "context_length" for i in range(8)}
    (line,) = failed_gate_violations("B1", _stats(eight), vcfg)
    assert "deterministic_failed_rate 0.1667 (8/48 responses: context_length 8; samples ctx-0" in line
    assert "and 3 more" in line and "does not send them again (never as sent" in line
    assert line.endswith("set validation.max_deterministic_failed_rate=0.17") and not rerun_may_pass(line)
    (resent,) = failed_gate_violations("B1", _stats(eight), vcfg, retry_failed="all")
    assert "the next run" not in resent and "never as sent" in resent
    refused = {f"bad-{i}": "http_400" for i in range(8)}
    (resent,) = failed_gate_violations("B1", _stats(refused), vcfg, retry_failed="all")
    assert "resent only by a run with endpoint.retry_failed: all (as this one had); or to accept" in resent

    transient = {f"t-{i}": "http_503" for i in range(3)} | {"o-1": "outage"}
    (line,) = failed_gate_violations("B1", _stats(transient), vcfg)
    assert "failed_rate 0.0833 (4/48 responses failed after their retries: http_503 3, outage 1" in line
    assert "retried by the next run" in line and rerun_may_pass(line)
    mixed = _stats({**transient, **eight})
    assert [rerun_may_pass(g) for g in failed_gate_violations("B1", mixed, vcfg)] == [True, False]


def test_rerun_summary_groups_by_what_the_next_run_does() -> None:
    records = [
        FailureRecord(f"s{i}", "B1", "responses", r, c, 1, None, rerun_action("responses", c, r)).to_dict()
        for i, (r, c) in enumerate([("http_500", "transient")] * 2 + [("context_length", "deterministic")])
    ]
    lines = rerun_summary(records)
    assert lines[0] == "2 transient (http_500 2): retried by the next run"
    assert lines[1].startswith("1 deterministic (context_length 1): never as sent")
    assert Counter(r["class"] for r in records) == {"transient": 2, "deterministic": 1}


@pytest.mark.usefixtures("prefect_harness")
def test_a_dataset_whose_failures_a_later_run_retried_gets_an_empty_table(tmp_path: Path) -> None:
    """The failed-samples card of a dataset kept showing the 4 transient failures a later run had retried as its
    latest version (a UI probe): a dataset of the run with none now gets an empty table saying so."""
    from prefect.artifacts import Artifact

    failed = FailureRecord("s1", "P20", "responses", "http_503", "transient", 4, "x", "retried").to_dict()
    run_dir = tmp_path / "stale"
    assert publish_failed_samples([failed], tmp_path / "f.jsonl", run_dir, ["P20", "B1"]) == [
        "failed-samples-b1-stale",
        "failed-samples-p20-stale",
    ]
    first = Artifact.get("failed-samples-p20-stale")
    assert first is not None and "1 failed samples" in (first.description or "") and "s1" in str(first.data)
    publish_failed_samples([], tmp_path / "f.jsonl", run_dir, ["P20", "B1"])
    latest = Artifact.get("failed-samples-p20-stale")
    assert latest is not None and latest.id != first.id and json.loads(str(latest.data)) == []
    assert (latest.description or "").startswith("No failed samples or quarantined rows in dataset P20 now")
    assert "since retried" in (latest.description or "")
    # B1 never had a failure: its empty tables claim no older failures (a UI probe read the claim on a first run)
    assert "older versions" not in (Artifact.get("failed-samples-b1-stale").description or "")
    publish_failed_samples([], tmp_path / "f.jsonl", run_dir, ["P20", "B1"])
    assert "since retried" in (Artifact.get("failed-samples-p20-stale").description or ""), "older versions still do"
    assert "older versions" not in (Artifact.get("failed-samples-b1-stale").description or "")


def test_the_rerun_outlook_names_the_run_form_override_as_well_as_the_cli_flag() -> None:
    """A UI user reads the rerun column, the failure-summary and the state message and triggers runs from the
    run form, where `--retry-failed all` means nothing (a UI probe): both ways of asking are named."""
    for reason in ("length", "http_400", "content_filter"):
        outlook = rerun_action("responses", "deterministic", reason)
        assert '{"endpoint.retry_failed": "all"}' in outlook, outlook
        assert "--retry-failed all" in outlook, outlook

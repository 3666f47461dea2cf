"""Texts a Prefect UI user reads: the run summary's failures by reason, the estimate's advice, the run form's
`run_dir` type (a UI probe found a Python dict, a CLI-only option, and `{"run_dir": 5}` accepted by the form)."""

from __future__ import annotations

import pytest

from tasks.common.run_summary import generate_rows


def test_failures_by_reason_in_the_run_summary_read_as_counts() -> None:
    stats = {"generate": {"total": {"failed": 9, "failures_by_reason": {"http_400": 2, "context_length": 7}}}}
    rows = {row["metric"]: row["value"] for row in generate_rows(stats)}
    assert rows["failures by reason"] == "context_length 7, http_400 2" and rows["failed"] == 9


def test_the_run_summary_has_a_row_for_failed_samples_kept_from_earlier_runs() -> None:
    """`samples 80 / done 0 / failed 0 / already done before this run 61` (a UI probe): the 19 deterministic
    failures kept from before, not sent again, were in no row."""
    total = {"samples": 80, "done": 0, "failed": 0, "skipped_already_done": 61, "kept_failed": 19}
    stats = {"generate": {"total": {**total, "kept_failed_by_reason": {"context_length": 15, "http_400": 4}}}}
    rows = {row["metric"]: row["value"] for row in generate_rows(stats)}
    assert rows["failed before this run, kept (not sent again)"] == 19
    assert rows["kept failures by reason"] == "context_length 15, http_400 4"


def test_the_estimate_in_a_prefect_run_does_not_advise_a_cli_option() -> None:
    import flows.pipeline as pipeline_module
    from tasks.estimate.display import estimate_text
    from tasks.estimate.estimate import DatasetEstimate, RunEstimate
    from tasks.estimate.prices import Prices

    est = RunEstimate(
        "m", [DatasetEstimate("B1", requests=3)], Prices(0.6, 2.5, "config"), 8, 64, None, 0.0, 0.0, None, None, None
    )
    assert "pass --observed RUN_DIR" in estimate_text(est)  # the CLI's own estimate
    in_a_run = estimate_text(est, no_latency=pipeline_module.NO_LATENCY_RUN)
    assert "--observed" not in in_a_run and "unknown (no observed latencies: this run directory holds no" in in_a_run


@pytest.mark.parametrize("run", [{"config_path": "a.yaml", "overrides": {"run_dir": 5}}, {"config": {"run_dir": 5}}])
def test_the_run_form_types_run_dir_as_a_string(run: dict[str, object]) -> None:
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate
    from prefect.utilities.schema_tools.validation import ValidationError as SchemaError

    from flows.pipeline import pipeline

    schema = parameter_schema(pipeline).model_dump_for_openapi()
    with pytest.raises(SchemaError, match="5 is not of type 'string'"):
        validate({"run": run}, schema, raise_on_error=True)

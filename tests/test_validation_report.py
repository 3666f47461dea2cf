"""The standalone validation report over real parts: plots, HTML with the plots embedded, markdown, summary.json,
and the Prefect task that writes it all before a crossed gate fails the flow."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread
from transformers import PreTrainedTokenizerBase

from tasks.common.config import PipelineConfig, ValidationConfig
from tasks.common.errors import ValidationGateError
from tasks.validate.checks import gate_violations, summarize_validation
from tasks.validate.report import write_validation_report
from tests.test_reconstruct import make_cfg
from tests.test_validate import CONTENT, EOS, REASONING, encode, run_part


def populated_run(run_dir: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase) -> PipelineConfig:
    """Two datasets: every reference class, a structural failure, billing deltas and two providers."""
    completion = encode(tokenizer, f"{REASONING}</think>{CONTENT}{EOS}")
    at = completion.index(encode(tokenizer, " NOR")[0])
    split = [*completion[:at], *encode(tokenizer, " "), *encode(tokenizer, "NOR"), *completion[at + 1 :]]
    changed = encode(tokenizer, f"{REASONING}</think>{CONTENT.replace('NOT', 'XOR')}{EOS}")
    cfg = make_cfg(run_dir, tokenizer_dir, token_ids="reencode")  # the gates judge rows storing re-encodings
    n = len(completion)
    cases: list[dict[str, Any]] = [
        {"output_ids": completion, "completion_tokens": n, "provider": "alpha"},
        {"output_ids": split, "completion_tokens": n + 1, "provider": "alpha"},
        {"output_ids": changed, "completion_tokens": n, "provider": "beta"},
        {"content": "Sure.</think>Actually.", "provider": "beta"},
        {"reasoning": "A much longer chain of thought. " * 20, "completion_tokens": 3 * n, "provider": "alpha"},
    ]
    run_part(cfg, 0, cases)
    other = [{"dataset": "B3", "completion_tokens": n, "provider": "alpha"} for _ in range(4)]
    run_part(cfg, 1, other)
    return cfg


def test_report_renders_plots_html_and_markdown(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    cfg = populated_run(tmp_path, tokenizer_dir, tokenizer)
    summary = summarize_validation(cfg)
    assert [s["dataset"] for s in summary] == ["B3", "demo"]
    violations = gate_violations(summary, ValidationConfig(fail_on_mixed_providers=True))
    assert violations
    report = write_validation_report(cfg.run_dir, summary, violations, 0.02)

    plots = sorted((tmp_path / "reports" / "plots").glob("*.png"))
    assert [p.name for p in plots] == ["billing_deltas.png", "mismatch_classes.png", "serving.png", "token_lengths.png"]
    for plot in plots:
        pixels = imread(plot)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 900
        assert float(np.std(pixels)) > 0.05  # something is drawn, not a blank canvas

    page = report.read_text()
    assert report.name == "report.html" and page.startswith("<!doctype html>")
    embedded = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(embedded) == 4
    assert {base64.b64decode(e) for e in embedded} == {p.read_bytes() for p in plots}
    assert "Validation gates crossed" in page and "served by a mix" in page
    assert "XOR" in page  # the first real difference, with the tokens on each side
    markdown = (tmp_path / "reports" / "report.md").read_text()
    assert "**GATES CROSSED**" in markdown and "![Token lengths](plots/token_lengths.png)" in markdown
    saved = json.loads((tmp_path / "reports" / "summary.json").read_text())
    assert saved["gates_crossed"] == violations and len(saved["datasets"]) == 2


def test_report_of_an_empty_run_still_renders(tmp_path: Path) -> None:
    report = write_validation_report(tmp_path, [], [], 0.02)
    assert "All validation gates passed" in report.read_text()
    assert len(list((tmp_path / "reports" / "plots").glob("*.png"))) == 4


def test_flow_task_writes_the_report_then_fails_the_gate(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: PreTrainedTokenizerBase, prefect_harness: None
) -> None:
    from flows.pipeline import validation_report_task

    cfg = populated_run(tmp_path, tokenizer_dir, tokenizer)
    with pytest.raises(ValidationGateError, match=r"real_difference_rate 0\.3333 \(1/3 referenced samples\)"):
        validation_report_task(cfg)
    page = (tmp_path / "reports" / "report.html").read_text()
    assert "Validation gates crossed" in page and "max_real_difference_rate" in page

    passing = cfg.model_copy(update={"validation": ValidationConfig(max_real_difference_rate=1.0)})
    summary = validation_report_task(passing)
    assert {s["dataset"] for s in summary} == {"B3", "demo"}
    assert "All validation gates passed" in (tmp_path / "reports" / "report.html").read_text()

"""A completion_format that names no preset is refused when the config is loaded: `estimate` and `run --dry-run`
used to accept it and only `generate` refused it, after a user had read an estimate for a run that cannot start."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.exit_codes import ExitCode
from tasks.common.config import COMPLETION_FORMAT_NAMES, load_config
from tasks.common.errors import ConfigError
from tasks.reconstruct.completion_format import PRESETS
from tests.conftest import REPO, run_main


def test_unknown_completion_format_fails_at_config_load_with_generates_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert set(PRESETS) == COMPLETION_FORMAT_NAMES, "tasks/common/config.py's copy of the preset names"
    config = REPO / "configs" / "run.yaml"
    run_dir = tmp_path / "run"
    for name in ("auto", *sorted(PRESETS)):
        assert load_config(config, {"tokenizer.completion_format": name}).tokenizer.completion_format == name
    expected = (
        f"unknown completion_format 'foo'; choose 'auto', one of {sorted(PRESETS)}, or write the format out "
        "(a mapping with end_of_turn, reasoning_open, ...)"
    )
    with pytest.raises(ConfigError) as refused:
        load_config(config, {"tokenizer.completion_format": "foo"})
    assert str(refused.value) == expected

    result = run_main(
        capsys, "estimate", str(config), "--set", f"run_dir={run_dir}", "--set", "tokenizer.completion_format=foo"
    )
    assert result.returncode == ExitCode.USER
    assert result.stderr.splitlines() == [f"error: {expected}"]
    assert not run_dir.exists()

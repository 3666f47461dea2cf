"""Checks a command makes before it starts anything expensive (a Prefect server, a tokenizer, a request): each
failure is a ConfigError naming the config key to change, so the user gets one line, not a traceback later."""

from __future__ import annotations

import os
from pathlib import Path

from tasks.common.config import PipelineConfig
from tasks.common.errors import ConfigError


def check_datasets(cfg: PipelineConfig) -> None:
    """Every configured dataset is a file (prepare checks this too, so a deployment run says it in one line)."""
    for i, ds in enumerate(cfg.datasets):
        if not ds.path.exists():
            raise ConfigError(f"dataset {ds.name}: {ds.path} does not exist; fix datasets[{i}].path")
        if not ds.path.is_file():
            raise ConfigError(f"dataset {ds.name}: {ds.path} is not a file; fix datasets[{i}].path")


def check_inputs(cfg: PipelineConfig) -> None:
    check_datasets(cfg)
    if not cfg.tokenizer.path.is_dir():
        raise ConfigError(f"tokenizer.path {cfg.tokenizer.path} is not a directory (the target model's local folder)")


def check_run_dir_writable(run_dir: Path) -> None:
    """The run directory, or the nearest folder that exists above it, must be a writable directory."""
    probe = run_dir
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"run_dir {run_dir}: {probe} is a file, not a directory; choose another run_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir {run_dir}: {probe} is not writable by this user; fix its permissions or run_dir")

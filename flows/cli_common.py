"""What the `eagle3-datagen` commands that run flows share (`run`, `demo`, `train`, `evaluate`): Prefect's
environment defaults, the demo's directories, and the summary printed at the end of a run.

Its own module so that `flows.cli` and `flows.train_cli` both import it and neither imports the other.
"""

# Prefect is imported lazily, after the environment defaults below are in place, because its settings are read
# once at import time.

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from flows.exit_codes import EPHEMERAL_STARTUP_DEFAULT_S, EPHEMERAL_STARTUP_SETTING

DEBUG = False
"""Set by `--debug` (`flows.cli.main`): errors come with their traceback and Prefect's own log is left as it is."""

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "false",
    # Prefect's 20 s for its embedded server to answer: it starts in 7-14 s on an idle 2-core machine, and
    # `make demo-real` beside three other jobs gave up at 20 s (exit 7) before anything ran.
    EPHEMERAL_STARTUP_SETTING: str(EPHEMERAL_STARTUP_DEFAULT_S),
}


class _NoTraceback(logging.Filter):
    """Prefect logs every failed task with its traceback; the console shows the message, the API keeps it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


def quiet_prefect_console() -> None:
    if not DEBUG:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_NoTraceback())


def prefect_env() -> None:
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not DEBUG:  # the run's log goes to stdout; stderr carries only the one-line error, if any
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_STREAM", "ext://sys.stdout")


@contextlib.contextmanager
def heartbeats_only_for_a_server() -> Iterator[None]:
    """Flow-run heartbeats let a Prefect server mark a run whose process died as crashed. Without
    PREFECT_API_URL the run has a temporary server of its own that dies with it: nobody is told, and every flow
    run would wait up to a second at its end for the heartbeat thread. With a server, they stay on. The temporary
    server is also made to die with the run when the run is killed (`server_reaper`)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    from flows.server_reaper import stop_temporary_server_with_this_process

    stop_temporary_server_with_this_process()  # a `kill -9` of the run used to leave the server running for good
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def demo_config_path() -> Path:
    return Path(str(resources.files("flows").joinpath("configs/demo.yaml")))


def demo_dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    """The demo's run directory (emptied first with --fresh) and its tiny target model, built once under
    --assets-dir; shared by `demo` and `demo --train`."""
    from endpoint_sim.assets import ensure_tiny_model_dir

    run_dir = Path(args.run_dir).resolve()
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    return run_dir, ensure_tiny_model_dir(Path(args.assets_dir).resolve() / "tiny-deepseek-v31")


def print_demo_summary(stats: dict[str, Any], wall_s: float) -> None:
    print_run_summary(stats, wall_s, "eagle3-datagen demo")


def print_run_summary(stats: dict[str, Any], wall_s: float, what: str) -> None:
    """What `demo` and `run` print at the end: the validation overview, then finished parts per stage."""
    from rich.console import Console
    from rich.table import Table

    from tasks.common.run_summary import stage_rows
    from tasks.generate.progress import format_usd

    console = Console()
    console.print(f"\n[bold]{what} finished in {wall_s:.1f} s[/bold]; run directory: {stats['run_dir']}")
    from tasks.validate.report import overview_rows

    overview = overview_rows(stats.get("validation_summary") or [])  # none after a budget stop
    table = Table(title="validation summary")
    table.add_column("metric")
    for row in overview:
        table.add_column(str(row["dataset"]), justify="right")
    for metric in overview[0] if overview else []:
        if metric != "dataset":
            table.add_row(metric, *(str(row[metric]) for row in overview))
    if overview:
        console.print(table)
    stages = Table(title="finished parts per stage")
    for column in ("stage", "parts", "rows", "bytes"):
        stages.add_column(column, justify="left" if column == "stage" else "right")
    for row in stage_rows(Path(stats["run_dir"])):
        stages.add_row(row["stage"], str(row["parts"]), str(row["rows"]), f"{row['bytes']:,}")
    console.print(stages)
    prep = stats["prepare"]
    gen = stats["generate"]["total"]
    empty_system = sum(d.get("empty_system_dropped", 0) for d in prep["datasets"].values())
    console.print(
        f"prompts kept {sum(d['kept'] for d in prep['datasets'].values())}, quarantined {prep['quarantined']} "
        f"({prep['quarantine_path']})"
        + (f", empty system turns left out {empty_system}" if empty_system else "")
        + "\n"
        f"this run: requests sent {gen['requests_sent']}, billed {format_usd(gen['cost_usd'] or 0)}, "
        f"pending {format_usd(gen.get('pending_usd') or 0)}; "
        f"report: {stats['run_dir']}/reports/report.html"
    )
    print_parity(console, stats.get("scores"))


def print_parity(console: Any, summary: dict[str, Any] | None) -> None:
    """The provider-parity table (the target's scores of each provider's answers), when the run scored any."""
    if not summary:
        return
    from rich.console import Console
    from rich.table import Table

    from tasks.scoring import provider_rows

    if not console.is_terminal:  # a log file or a pipe: the table is wider than 80 columns
        console = Console(width=200)
    columns = ("serving", "samples", "mean NLL", "NLL vs others", "top-1 rate", "top-1 vs others", "verdict")
    table = Table(title="provider parity (the target's scores of the answers; full table in the report)")
    for column in columns:
        table.add_column(column, justify="left" if column in ("serving", "verdict") else "right")
    for row in provider_rows(summary):
        table.add_row(*(row[c] for c in columns))
    console.print(table)
    for line in summary.get("named_lines", []):
        console.print(f"[bold red]provider parity:[/bold red] {line}")

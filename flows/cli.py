"""`eagle3-datagen` command line: `run CONFIG.yaml`, `demo`, `generate CONFIG.yaml` (no Prefect), and
`export RUN_DIR` (trainer layouts).

Prefect is imported lazily, after the environment defaults below are in place, because its settings are read
once at import time; `generate` and `export` never import it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from tasks.common.config import PipelineConfig
    from tasks.generate.engine import GenerateSummary
    from tasks.generate.progress import Listener

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_UI_ENABLED": "false",
}


def _prefect_env() -> None:
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _parse_overrides(pairs: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def demo_config_path() -> Path:
    return Path(str(resources.files("flows").joinpath("configs/demo.yaml")))


def cmd_run(args: argparse.Namespace) -> int:
    _prefect_env()
    from flows.params import RunParameters
    from flows.pipeline import pipeline

    run = RunParameters(
        config_path=str(Path(args.config).resolve()),
        overrides=_parse_overrides(args.set or []),
        endpoint_block=args.endpoint_block,
    )
    from tasks.generate.progress_display import show_progress

    with show_progress(enabled=not args.no_progress):
        stats = pipeline(run)
    print(json.dumps({k: stats[k] for k in ("run_dir", "wall_s")}, indent=2))
    if stats.get("stopped") == "budget":
        from tasks.generate.engine import budget_stop_message

        spent = stats["generate"]["total"]["run_dir_spent_usd"]
        print(budget_stop_message(spent, stats["config"]["endpoint"]["max_cost_usd"]), file=sys.stderr)
        return EXIT_BUDGET
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.train:
        from flows.train_cli import cmd_demo_train

        return cmd_demo_train(args)
    _prefect_env()
    from endpoint_sim.assets import ensure_tiny_model_dir
    from endpoint_sim.server import SimConfig, SimulatorServer
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from tasks.generate.progress_display import show_progress

    run_dir = Path(args.run_dir).resolve()
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    model_dir = ensure_tiny_model_dir(Path(args.assets_dir).resolve() / "tiny-deepseek-v31")
    started = time.monotonic()
    sim_config = SimConfig(noncanonical_rate=args.noncanonical_rate)
    with SimulatorServer(model_dir, sim_config) as sim, show_progress(enabled=not args.no_progress):
        overrides = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(model_dir),
        }
        stats = pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides))
    wall_s = time.monotonic() - started
    print_demo_summary(stats, wall_s)
    return 0


def print_demo_summary(stats: dict[str, Any], wall_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"\n[bold]eagle3-datagen demo finished in {wall_s:.1f} s[/bold]; run directory: {stats['run_dir']}")
    from tasks.validate.report import overview_rows

    overview = overview_rows(stats["validation_summary"])
    table = Table(title="validation summary")
    table.add_column("metric")
    for row in overview:
        table.add_column(str(row["dataset"]), justify="right")
    for metric in overview[0] if overview else []:
        if metric != "dataset":
            table.add_row(metric, *(str(row[metric]) for row in overview))
    console.print(table)
    prep = stats["prepare"]
    gen = stats["generate"]["total"]
    console.print(
        f"prompts kept {sum(d['kept'] for d in prep['datasets'].values())}, quarantined {prep['quarantined']} "
        f"({prep['quarantine_path']})\n"
        f"requests sent {gen['requests_sent']}, cost ${gen['cost_usd'] or 0:.4f}; "
        f"hidden-state parts {len(stats.get('extract', []))}; report: {stats['run_dir']}/validation/report.html"
    )


EXIT_BUDGET = 3
EXIT_FATAL_ENDPOINT = 2
EXIT_ERROR = 1


def generate_without_prefect(
    cfg: PipelineConfig, listeners: list[Listener] | None = None
) -> tuple[GenerateSummary, list[int]]:
    """prepare + generate as plain calls: what `generate` runs, and what a crash test can kill at any point."""
    from tasks.common.shards import PartRef
    from tasks.generate.endpoints import CompletionMarkers
    from tasks.generate.engine import generate_parts
    from tasks.prepare.datasets import prepare_datasets
    from tasks.reconstruct.completion_format import format_for
    from tasks.reconstruct.tokenizer_loading import load_tokenizer

    parts = prepare_datasets(cfg).parts
    tokenizer = load_tokenizer(cfg.tokenizer)
    markers = CompletionMarkers(*format_for(cfg, tokenizer).markers())
    refs = [PartRef(cfg.run_dir, "prompts", p) for p in parts]
    return generate_parts(cfg, refs, markers, tokenizer, listeners=listeners), parts


def _redactor(cfg: PipelineConfig) -> Callable[[object], str]:
    from tasks.common.errors import ConfigError

    try:
        key = cfg.endpoint.resolved_api_key()
    except ConfigError:  # the key variable is unset: there is nothing to hide, and generate reports it
        key = None
    if not key:
        return str
    secret = key
    return lambda text: str(text).replace(secret, "***")


def _config_error(exc: Exception) -> str:
    """Pydantic echoes offending input values; an api_key typo must not reach the terminal."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_input=False)]
        return "invalid config:\n" + "\n".join(lines)
    return str(exc)


def print_dataset_table(rows: list[dict[str, Any]], title: str = "responses per dataset") -> None:
    """Metrics as rows, datasets as columns: thirteen metrics do not fit side by side in a terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: no reason to wrap at 80 columns
        console = Console(width=200)
    table = Table(title=title)
    table.add_column("metric")
    for row in rows:
        table.add_column(str(row["dataset"]), justify="right")
    for metric in rows[0] if rows else []:
        if metric != "dataset":
            table.add_row(metric, *("-" if row[metric] is None else str(row[metric]) for row in rows))
    console.print(table)


def cmd_generate(args: argparse.Namespace) -> int:
    """Exit codes: 0 complete (failed samples included), 3 stopped at the budget cap, 2 endpoint refused the
    run (401/402), 1 any other error. No Prefect, so it can run (and be killed) as a plain process."""
    from pydantic import ValidationError

    from tasks.common.config import load_config
    from tasks.common.errors import ConfigError, DatagenError, EndpointUnavailableError, FatalEndpointError
    from tasks.generate.dataset_summary import dataset_rows
    from tasks.generate.engine import budget_stop_message
    from tasks.generate.progress_display import show_progress

    try:
        cfg = load_config(Path(args.config), _parse_overrides(args.set or []))
    except (ConfigError, ValidationError) as exc:
        print(f"error: {_config_error(exc)}", file=sys.stderr)
        return EXIT_ERROR
    redact = _redactor(cfg)
    try:
        with show_progress(enabled=not args.no_progress):
            summary, parts = generate_without_prefect(cfg)
    except FatalEndpointError as exc:
        print(f"error: {redact(exc)}", file=sys.stderr)
        return EXIT_FATAL_ENDPOINT
    except (DatagenError, EndpointUnavailableError) as exc:
        print(f"error: {type(exc).__name__}: {redact(exc)}", file=sys.stderr)
        return EXIT_ERROR
    print_dataset_table(dataset_rows(cfg.run_dir, parts))
    print(json.dumps(summary.total(), default=str), flush=True)
    if summary.stopped != "budget":
        return 0
    print(
        f"{budget_stop_message(summary.spent_usd, cfg.endpoint.max_cost_usd)} In {cfg.run_dir}, e.g.: "
        f"eagle3-datagen generate {args.config} --set endpoint.max_cost_usd=<higher>",
        file=sys.stderr,
    )
    return EXIT_BUDGET


def cmd_export(args: argparse.Namespace) -> int:
    """No Prefect: an export is a local file conversion of a finished run directory."""
    from tasks.export import export_run

    stats = export_run(Path(args.run_dir).resolve(), args.format, Path(args.out).resolve())
    print(json.dumps(stats, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-datagen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline flow on a config file")
    run.add_argument("config")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (dotted key)")
    run.add_argument("--endpoint-block", help="InferenceEndpointBlock name whose fields and key replace endpoint")
    run.add_argument("--no-progress", action="store_true", help="no live generate progress display")
    run.set_defaults(func=cmd_run)
    demo = sub.add_parser("demo", help="start the local endpoint simulator and run the bundled demo config")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("--assets-dir", default="runs/_assets")
    demo.add_argument("--fresh", action="store_true", help="delete the run directory first")
    demo.add_argument("--noncanonical-rate", type=float, default=0.1)
    demo.add_argument("--no-progress", action="store_true", help="no live generate progress display")
    demo.add_argument("--train", action="store_true", help="answers from the tiny target itself, then train + evaluate")
    demo.set_defaults(func=cmd_demo)
    gen = sub.add_parser("generate", help="prepare + generate only, without Prefect (resumable; exit 3 = budget cap)")
    gen.add_argument("config")
    gen.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (dotted key)")
    gen.add_argument("--no-progress", action="store_true", help="no live progress display")
    gen.set_defaults(func=cmd_generate)
    export = sub.add_parser("export", help="write a run's hidden states in a trainer's offline layout")
    export.add_argument("run_dir")
    export.add_argument("--format", required=True, choices=["specforge", "speculators"])
    export.add_argument("--out", required=True, help="output directory (created; resumable)")
    export.set_defaults(func=cmd_export)
    from flows.train_cli import add_train_commands

    add_train_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

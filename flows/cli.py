"""`eagle3-datagen` command line: `run CONFIG.yaml`, `demo`, and `export RUN_DIR` (trainer layouts).

Prefect is imported lazily, after the environment defaults below are in place, because its settings are read
once at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

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
    stats = pipeline(run)
    print(json.dumps({k: stats[k] for k in ("run_dir", "wall_s")}, indent=2))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    _prefect_env()
    from endpoint_sim.assets import ensure_tiny_model_dir
    from endpoint_sim.server import SimConfig, SimulatorServer
    from flows.params import RunParameters
    from flows.pipeline import pipeline

    run_dir = Path(args.run_dir).resolve()
    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    model_dir = ensure_tiny_model_dir(Path(args.assets_dir).resolve() / "tiny-deepseek-v31")
    started = time.monotonic()
    sim_config = SimConfig(noncanonical_rate=args.noncanonical_rate)
    with SimulatorServer(model_dir, sim_config) as sim:
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
    from tasks.report import overview_rows

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
    run.set_defaults(func=cmd_run)
    demo = sub.add_parser("demo", help="start the local endpoint simulator and run the bundled demo config")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("--assets-dir", default="runs/_assets")
    demo.add_argument("--fresh", action="store_true", help="delete the run directory first")
    demo.add_argument("--noncanonical-rate", type=float, default=0.1)
    demo.set_defaults(func=cmd_demo)
    export = sub.add_parser("export", help="write a run's hidden states in a trainer's offline layout")
    export.add_argument("run_dir")
    export.add_argument("--format", required=True, choices=["specforge", "speculators"])
    export.add_argument("--out", required=True, help="output directory (created; resumable)")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

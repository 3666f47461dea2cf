"""Make EAGLE-3 drafter training data from a target model's own answers: send your prompt datasets to an
OpenAI-compatible endpoint (OpenRouter, SGLang, vLLM), rebuild the exact token ids, validate them, and store the
target's hidden states for training.

Start with `eagle3-datagen demo` (a local simulated endpoint, nothing to configure), then
`eagle3-datagen estimate my-run.yaml` to see what your own run will cost, and `eagle3-datagen run my-run.yaml`.
"""

# Prefect is imported lazily, after the environment defaults below are in place, because its settings are read
# once at import time; `generate`, `estimate` and `export` never import it.

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from flows import cli_common
from flows.cli_common import (
    demo_config_path,
    demo_dirs,
    heartbeats_only_for_a_server,
    prefect_env,
    print_demo_summary,
    print_run_summary,
    quiet_prefect_console,
)
from flows.exit_codes import ExitCode, error_line, exit_code_for, exit_code_table

if TYPE_CHECKING:
    from tasks.common.config import PipelineConfig
    from tasks.generate.engine import GenerateSummary
    from tasks.generate.progress import Listener

__all__ = ["demo_config_path", "main", "print_demo_summary", "print_run_summary"]


def _parse_overrides(pairs: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            from tasks.common.errors import ConfigError

            raise ConfigError(f"--set expects KEY=VALUE (e.g. endpoint.max_in_flight=500), got {pair!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


DEMO_RUN_DIR = "runs/demo"
REAL_DEMO_RUN_DIR = "runs/demo-real"


def cmd_run(args: argparse.Namespace) -> int:
    prefect_env()
    overrides = _parse_overrides(args.set or [])
    config_path = Path(args.config).resolve()
    if not args.endpoint_block:  # a config mistake is reported before a Prefect server is started for nothing
        from tasks.common.config import load_config

        _prepare_then_wait(load_config(config_path, overrides), probe=not args.dry_run)
    from flows.params import RunParameters
    from flows.pipeline import pipeline

    quiet_prefect_console()
    run = RunParameters(
        config_path=str(config_path), overrides=overrides, endpoint_block=args.endpoint_block, dry_run=args.dry_run
    )
    from tasks.generate.progress_display import show_progress

    started = time.monotonic()
    with show_progress(enabled=not args.no_progress, events=False), heartbeats_only_for_a_server():
        stats = pipeline(run)
    if stats.get("dry_run"):
        print(stats["estimate"]["text"])
        return ExitCode.OK
    print_run_summary(stats, time.monotonic() - started, "eagle3-datagen run")
    _announce_pending(stats["generate"]["total"].get("spend") or {}, stats["config"]["endpoint"]["account_settlement"])
    _announce_quarantine(Path(stats["run_dir"]))
    if stats.get("status", {}).get("problems"):
        print("stages disagree: " + "; ".join(stats["status"]["problems"]), file=sys.stderr)
    if stats.get("stopped") == "budget":
        from tasks.generate.engine import budget_stop_message

        total = stats["generate"]["total"]
        cap = stats["config"]["endpoint"]["max_cost_usd"]
        settlement = stats["config"]["endpoint"]["account_settlement"]
        message = budget_stop_message(total["run_dir_counted_usd"], cap, total["run_dir_pending_usd"], settlement)
        print(message, file=sys.stderr)
        return EXIT_BUDGET
    return ExitCode.OK


def _preflight(cfg: PipelineConfig, sending: bool = True) -> None:
    """Inputs exist, the run directory is writable and (`sending`) the API key the config names is set: before
    anything starts (an unset `api_key_env` was reported after the datasets were prepared and Prefect started)."""
    from tasks.common.preflight import check_inputs, check_run_dir_writable

    check_inputs(cfg)
    check_run_dir_writable(cfg.run_dir)
    if sending:
        cfg.endpoint.resolved_api_key()


def _tell(line: str) -> None:
    """A line about what the command is waiting for, at once, on stdout with the run's log (stderr carries only
    the one-line error, if any)."""
    print(line, flush=True)


def _prepare_then_wait(cfg: PipelineConfig, probe: bool) -> None:
    """What `run` settles before it starts Prefect, in this order: the inputs (files, then rows: a dataset that is
    empty or all quarantined is one line and exit 2 at once), the tokenizer, its completion format and special
    tokens (as `generate` checks them), then, only when something is left to send, the endpoint, waited for up
    to endpoint.outage_abort_s with a line saying so right away (a wrong tokenizer.path used to be reported only
    after that wait). Preparing here is the pipeline's own prepare step (append-only parts), which then finds
    them done."""
    from tasks.generate.preflight import preflight
    from tasks.prepare.datasets import prepare_datasets
    from tasks.reconstruct.tokenizer_loading import load_tokenizer
    from tasks.status.sending import parts_to_send

    _preflight(cfg, sending=probe)
    parts = prepare_datasets(cfg).parts
    preflight(cfg, load_tokenizer(cfg.tokenizer), probe=probe and bool(parts_to_send(cfg, parts)), announce=_tell)


def cmd_estimate(args: argparse.Namespace) -> int:
    """No Prefect and no completion request: reads the datasets and the run directory, may read a models listing."""
    from tasks.common.config import load_config

    cfg = load_config(Path(args.config), _parse_overrides(args.set or []))
    from tasks.common.preflight import check_inputs

    check_inputs(cfg)
    from tasks.estimate.display import estimate_text
    from tasks.estimate.estimate import estimate_run, over_budget
    from tasks.generate.preflight import preflight
    from tasks.reconstruct.tokenizer_loading import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer)
    preflight(cfg, tokenizer, probe=False)  # a tokenizer `generate` refuses is not estimated as if it would run
    observed = Path(args.observed).resolve() if args.observed else None
    estimate = estimate_run(cfg, tokenizer, observed_run_dir=observed, price_lookup=not args.no_price_lookup)
    if args.json:
        print(json.dumps(estimate.to_dict(), indent=2, default=str))
    else:
        print(estimate_text(estimate))
    reason = over_budget(estimate)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return ExitCode.BUDGET
    return ExitCode.OK


def cmd_demo(args: argparse.Namespace) -> int:
    if args.real:
        from flows.real_demo import cmd_demo_real

        if args.run_dir == DEMO_RUN_DIR:
            args.run_dir = REAL_DEMO_RUN_DIR
        return cmd_demo_real(args)
    if args.train:
        from flows.train_cli import cmd_demo_train

        return cmd_demo_train(args)
    prefect_env()
    from endpoint_sim.server import SimConfig, SimulatorServer
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from tasks.generate.progress_display import show_progress

    quiet_prefect_console()
    run_dir, model_dir = demo_dirs(args)
    started = time.monotonic()
    sim_config = SimConfig(noncanonical_rate=args.noncanonical_rate)
    with SimulatorServer(model_dir, sim_config) as sim, show_progress(enabled=not args.no_progress, events=False):
        overrides = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(model_dir),
        }
        with heartbeats_only_for_a_server():
            stats = pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides))
    wall_s = time.monotonic() - started
    print_demo_summary(stats, wall_s)
    _announce_quarantine(run_dir)
    return 0


EXIT_BUDGET = ExitCode.BUDGET
EXIT_FATAL_ENDPOINT = ExitCode.ENDPOINT
EXIT_ERROR = ExitCode.USER
EXIT_GATE = ExitCode.GATES
"""More samples failed than `validation.max_failed_rate` allows (generate); the failed ids are in the status file."""
EXIT_INCONSISTENT = ExitCode.STAGES_DISAGREE
"""`status`: stages disagree (stale parts, samples missing from a stage); a rerun rebuilds them."""


def _announce_pending(spend: dict[str, Any], account_settlement: str) -> None:
    from tasks.generate.settlement import pending_notice

    notice = pending_notice(spend, account_settlement)
    if notice:
        print(notice, file=sys.stderr)


def _announce_quarantine(run_dir: Path) -> None:
    from tasks.status.report import quarantine_notice

    notice = quarantine_notice(run_dir)
    if notice:
        print(notice, file=sys.stderr)


def generate_without_prefect(
    cfg: PipelineConfig, listeners: list[Listener] | None = None
) -> tuple[GenerateSummary, list[int]]:
    """prepare + generate as plain calls: what `generate` runs, and what a crash test can kill at any point."""
    from tasks.common.shards import PartRef
    from tasks.generate.endpoints import CompletionMarkers
    from tasks.generate.engine import generate_parts
    from tasks.generate.preflight import preflight
    from tasks.prepare.datasets import prepare_datasets
    from tasks.prepare.empty_input import require_prompts
    from tasks.reconstruct.tokenizer_loading import load_tokenizer
    from tasks.status.sending import parts_to_send

    prepared = prepare_datasets(cfg)
    require_prompts(prepared.to_dict(), {ds.name: str(ds.path) for ds in cfg.datasets})
    parts = prepared.parts
    tokenizer = load_tokenizer(cfg.tokenizer)
    # what `run` checks before its first paid request; no endpoint wait when nothing is left to send
    fmt, _ = preflight(cfg, tokenizer, probe=bool(parts_to_send(cfg, parts)), announce=_tell)
    markers = CompletionMarkers.of(fmt)
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
    """Exit codes as in the table (`--help`): 0 complete (failed samples included), 3 stopped at the budget cap,
    4 the endpoint refused the run or is unreachable, 2 a config or input error. No Prefect, so it can run (and be
    killed) as a plain process."""
    from tasks.common.config import load_config

    overrides = _parse_overrides(args.set or [])
    if args.retry_failed:
        overrides["endpoint.retry_failed"] = args.retry_failed
    cfg = load_config(Path(args.config), overrides)  # before the heavy imports: a typo is reported at once
    _SECRETS.append(_redactor(cfg))
    _preflight(cfg)  # the endpoint is waited for inside, after the rows are read, only if anything is left to send
    from tasks.generate.dataset_summary import dataset_rows
    from tasks.generate.engine import budget_stop_message
    from tasks.generate.progress_display import show_progress

    with show_progress(enabled=not args.no_progress):
        summary, parts = generate_without_prefect(cfg)
    rows = dataset_rows(cfg.run_dir, parts)
    print_dataset_table(rows)
    print(json.dumps(summary.total(), default=str), flush=True)
    _announce_pending(summary.spend, cfg.endpoint.account_settlement)
    _announce_quarantine(cfg.run_dir)
    if summary.stopped != "budget":
        from tasks.validate.failure_gates import responses_gate_violations

        crossed = responses_gate_violations(cfg.run_dir, parts, cfg.validation, cfg.endpoint.retry_failed)
        for line in crossed:
            print(f"error: {line} (`eagle3-datagen status {cfg.run_dir}` lists every failed sample)", file=sys.stderr)
        return EXIT_GATE if crossed else 0
    ep = cfg.endpoint
    print(
        f"{budget_stop_message(summary.counted_usd, ep.max_cost_usd, summary.pending_usd, ep.account_settlement)} "
        f"In {cfg.run_dir}, e.g.: eagle3-datagen generate {args.config} "
        + "".join(f"--set {shlex.quote(s)} " for s in args.set or [] if not s.startswith("endpoint.max_cost_usd="))
        + "--set endpoint.max_cost_usd=<higher>",
        file=sys.stderr,
    )
    return EXIT_BUDGET


def cmd_export(args: argparse.Namespace) -> int:
    """No Prefect: an export is a local file conversion of a finished run directory."""
    from tasks.export import export_run

    stats = export_run(
        Path(args.run_dir).resolve(),
        args.format,
        Path(args.out).resolve(),
        val_fraction=args.val_fraction,
        draft_vocab_size=args.draft_vocab_size,
        target_model=Path(args.target_model).resolve() if args.target_model else None,
        score_policy=args.score_policy,
        max_length=args.max_length,
    )
    print(json.dumps(stats, indent=2))
    for warning in stats["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """No Prefect, no model: reads markers and id columns. Exit 0 when every stage holds what the stage before it
    finished, EXIT_GATE when the last report crossed validation gates (a rerun stops there again),
    EXIT_INCONSISTENT when stages disagree otherwise (a rerun rebuilds them), EXIT_ERROR when RUN_DIR is no run
    directory."""
    from rich.console import Console
    from rich.table import Table

    from tasks.status.report import rerun_summary, run_status, write_failed_file
    from tasks.status.unfinished import answers_in_unfinished_parts, spend_summary, status_notes

    run_dir = Path(args.run_dir).resolve()
    if not (run_dir / "prompts").is_dir():
        print(f"error: {run_dir} is not a run directory (no prompts/ stage folder)", file=sys.stderr)
        return EXIT_ERROR
    recipes = None
    settings: dict[str, Any] = {}
    spill_setting: Path | None = None
    if args.config:
        from tasks.common.config import load_config
        from tasks.reconstruct.completion_format import format_for
        from tasks.reconstruct.tokenizer_loading import load_tokenizer
        from tasks.status.plan import recipe_digests

        cfg = load_config(Path(args.config), _parse_overrides(args.set or []))
        recipes = recipe_digests(cfg, format_for(cfg, load_tokenizer(cfg.tokenizer)))
        settings = {
            "extract_enabled": cfg.extract.enabled,
            "skip_failed_validation": cfg.extract.skip_failed_validation,
            "retry_failed": cfg.endpoint.retry_failed,
            "scoring_enabled": cfg.scores_extracted,
        }
        spill_setting = cfg.endpoint.spill_dir
    status = run_status(run_dir, recipes, **settings)
    failed_file = write_failed_file(status, Path(args.failed_out).resolve() if args.failed_out else None)
    records = status.failure_records()
    if args.json:
        payload = {**status.to_dict(), "failed_file": str(failed_file), "failed_samples": records}
        payload["spend"] = spend_summary(run_dir)
        payload["answers_in_unfinished_parts"] = answers_in_unfinished_parts(run_dir)
        print(json.dumps(payload, indent=2, default=str))
    else:
        console = Console() if Console().is_terminal else Console(width=200)
        rows = status.rows()
        table = Table(title=f"status of {run_dir}")
        for column in rows[0] if rows else ["dataset"]:
            table.add_column(column, justify="left" if column in ("dataset", "stage", "failed_by_reason") else "right")
        for row in rows:
            table.add_row(*(str(v) for v in row.values()))
        console.print(table)
        if records:
            console.print(failed_samples_table(records, FAILED_SHOWN, str(failed_file)))
        for line in status_notes(run_dir, spill_setting):
            print(line)
    if status.failed or status.quarantined:
        print(
            f"{len(status.failed)} failed samples, {len(status.quarantined)} quarantined rows: listed in {failed_file}",
            file=sys.stderr,
        )
        for line in rerun_summary(status.failed):
            print(f"  {line}", file=sys.stderr)
    _announce_quarantine(run_dir)
    for gate in status.gates_crossed:
        outlook = "a rerun retries these" if gate not in status.blocking_gates else "a rerun stops here again"
        print(f"validation gate crossed ({outlook}): {gate}", file=sys.stderr)
    outlook = "rerun to rebuild them" if status.rerun_completes else "a rerun stops at the validation gates above"
    for problem in status.problems:
        print(f"stages disagree: {problem} ({outlook})", file=sys.stderr)
    if status.gates_crossed:
        return EXIT_GATE
    return 0 if status.consistent else EXIT_INCONSISTENT


FAILED_SHOWN = 20
"""Failed samples `status` prints as a table; all of them are in the failed-samples file."""


def failed_samples_table(records: list[dict[str, Any]], shown: int, where: str) -> Any:
    """The first `shown` failure records as a rich table with `FAILURE_COLUMNS`, titled with the full file."""
    from rich.table import Table

    from tasks.common.failures import FAILURE_COLUMNS
    from tasks.status.report import display_cell

    more = f", first {shown} shown" if len(records) > shown else ""
    table = Table(title=f"failed samples ({len(records)}{more}; all in {where})")
    for column in FAILURE_COLUMNS:
        table.add_column(column, overflow="fold")
    for record in records[:shown]:
        table.add_row(*(display_cell(record, c) for c in FAILURE_COLUMNS))
    return table


CONFIG_HELP = "pipeline config YAML (see configs/run.yaml; relative paths resolve against the file)"
SET_HELP = "override one config value by dotted key, e.g. endpoint.max_in_flight=500 (repeatable)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eagle3-datagen")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3-datagen",
        description=__doc__,
        epilog="exit codes (every command):\n" + exit_code_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and Prefect's full log on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run every stage on your config (prints the estimate first)")
    run.add_argument("config", help=CONFIG_HELP)
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    run.add_argument(
        "--endpoint-block", help="name of a saved InferenceEndpointBlock whose fields and API key replace endpoint"
    )
    run.add_argument("--dry-run", action="store_true", help="prepare and estimate only; send nothing")
    run.add_argument("--no-progress", action="store_true", help="no live generate progress display")
    run.set_defaults(func=cmd_run)
    estimate = sub.add_parser("estimate", help="what a run will cost and how long it will take; sends nothing")
    estimate.add_argument("config", help=CONFIG_HELP)
    estimate.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    estimate.add_argument(
        "--observed",
        metavar="RUN_DIR",
        help="a finished run directory whose completion lengths and latencies to expect (default: the config's "
        "run_dir when it holds finished samples; otherwise completions are bounded by sampling.max_tokens)",
    )
    estimate.add_argument(
        "--no-price-lookup", action="store_true", help="never read the endpoint's models listing for prices"
    )
    estimate.add_argument("--json", action="store_true", help="print the estimate as JSON")
    estimate.set_defaults(func=cmd_estimate)
    demo = sub.add_parser("demo", help="try it: a local simulated endpoint and the bundled demo data, all stages")
    demo.add_argument("--run-dir", default=DEMO_RUN_DIR, help="where the demo's run directory goes")
    demo.add_argument("--assets-dir", default="runs/_assets", help="where the tiny demo model is built once")
    demo.add_argument("--fresh", action="store_true", help="delete the run directory first")
    demo.add_argument(
        "--noncanonical-rate",
        type=float,
        default=0.1,
        help="share of simulated answers whose reference token ids are a non-canonical tokenization (0..1)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no live generate progress display")
    demo.add_argument("--train", action="store_true", help="answers from the tiny target itself, then train + evaluate")
    demo.add_argument(
        "--real",
        action="store_true",
        help="every stage on a real model, SmolLM2-135M-Instruct (the realmodel extra; run dir runs/demo-real): "
        "its own answers vs other answers of the same length, 14-17 minutes on 2 idle cores",
    )
    demo.add_argument("--threads", type=int, default=2, help="--real: torch threads of the model-backed endpoint")
    demo.add_argument("--quick", action="store_true", help="--real: 24 short answers, 8 steps: a smoke run, no figure")
    demo.set_defaults(func=cmd_demo)
    gen = sub.add_parser("generate", help="prepare + generate only, without Prefect (resumable)")
    gen.add_argument("config", help=CONFIG_HELP)
    gen.add_argument("--set", action="append", metavar="KEY=VALUE", help=SET_HELP)
    gen.add_argument("--no-progress", action="store_true", help="no live progress display")
    gen.add_argument(
        "--retry-failed",
        choices=["transient", "all"],
        help="which committed failed samples to send again (default endpoint.retry_failed: transient; "
        "deterministic failures only when their settings changed)",
    )
    gen.set_defaults(func=cmd_generate)
    export = sub.add_parser("export", help="write a run's hidden states in a trainer's offline layout")
    export.add_argument("run_dir", help="a run directory with finished hidden_states parts")
    export.add_argument("--format", required=True, choices=["specforge", "speculators"], help="trainer layout")
    export.add_argument("--out", required=True, help="output directory (created; resumable)")
    export.add_argument("--val-fraction", type=float, default=0.05, help="fraction of prompts held out (by hash)")
    export.add_argument("--draft-vocab-size", type=int, help="also write d2t/t2d with the trainer's own utility")
    export.add_argument("--target-model", help="target model directory (default: the one extract recorded)")
    export.add_argument(
        "--max-length",
        type=int,
        help="specforge: the data.max_length you will train with (default 2048, SpecForge's); the draft "
        "vocabulary counts each sample's first MAX_LENGTH tokens, as SpecForge does",
    )
    export.add_argument(
        "--score-policy",
        choices=["keep", "flag", "drop"],
        help="samples outside the scoring bounds: keep, flag in the manifest, or drop "
        "(default: the run's scoring.sample_policy)",
    )
    export.set_defaults(func=cmd_export)
    status = sub.add_parser(
        "status", help="samples expected/done/failed/stale/missing per dataset and stage (exit 6: stages disagree)"
    )
    status.add_argument("run_dir", help="the run directory to inspect")
    status.add_argument("--config", help="also mark parts built with another config (format, layers...) stale")
    status.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a --config value")
    status.add_argument("--failed-out", help="where to write failed + quarantined samples (JSONL)")
    status.add_argument("--json", action="store_true", help="print the status as JSON instead of a table")
    status.set_defaults(func=cmd_status)
    from flows.train_cli import add_train_commands

    add_train_commands(sub)
    for command in sub.choices.values():  # every command documents the same exit codes
        command.epilog = command.epilog or parser.epilog
        command.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


_SECRETS: list[Callable[[object], str]] = []
"""Redactors of the API keys of configs the running command loaded: an error line never shows a key."""


def _redact(text: str) -> str:
    for redact in _SECRETS:
        text = redact(text)
    return text


def debug_traceback(exc: BaseException) -> str:
    """The traceback `--debug` prints. A config error's own text is pydantic's, which echoes input values and
    names an unknown key by its text (`api_key:sk-...`, a key typed without a space after the colon): anywhere in
    the chain it is replaced by the masked line."""
    from flows.exit_codes import config_error_line, is_validation_error

    text = "".join(traceback.format_exception(exc))
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if is_validation_error(link):
            text = text.replace(str(link), config_error_line(link))
        link = link.__cause__ or link.__context__
    return text


def main(argv: list[str] | None = None) -> int:
    """Every error a user can fix is one line on stderr and a code from flows/exit_codes.py; `--debug` (anywhere
    on the line) shows the traceback before it (redacted like the line), with the same exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cli_common.DEBUG = "--debug" in argv
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        print("error: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as exc:
        if cli_common.DEBUG:  # the traceback too, and the same exit code as without --debug
            print(_redact(debug_traceback(exc)), file=sys.stderr)
        print(error_line(exc, _redact), file=sys.stderr)
        return int(exit_code_for(exc))
    return int(result)


if __name__ == "__main__":
    sys.exit(main())

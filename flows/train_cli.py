"""`eagle3-datagen train RUN_DIR`, `eagle3-datagen evaluate RUN_DIR` and `eagle3-datagen demo --train`.

`train` and `evaluate` run as Prefect flows (`flows/train_flow.py`) so their metrics land as artifacts;
`--no-prefect` runs the plain `tasks.train` / `tasks.evaluate` calls. `demo --train` serves the demo's answers from
the tiny target model itself (`endpoint_sim.model_backend`, greedy), runs the pipeline, then trains a drafter on
the run and prints its acceptance next to an untrained one's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

DEMO_TRAIN_OVERRIDES: dict[str, Any] = {
    # the drafter is evaluated along the target's greedy decode, so the demo's answers are the target's greedy ones
    "sampling.temperature": 0.0,
    "sampling.top_p": 1.0,
}
DEMO_SIM_WORDS: dict[str, Any] = {"reasoning_words": (24, 64), "content_words": (16, 48)}
"""Answer lengths in tokens of the model-backed demo endpoint."""

DEMO_TRAIN: dict[str, Any] = {
    "epochs": 6,
    "lr": 3e-3,
    "total_seq_len": 1024,
    "draft_vocab_size": 4096,
    "val_fraction": 0.1,  # of 80 demo prompts: ~8 held out
}
DEMO_EVAL: dict[str, Any] = {"max_new_tokens": 64, "max_prompts": 8}


def add_train_commands(sub: Any) -> None:
    train = sub.add_parser("train", help="train an EAGLE-3 drafter on a run directory (speculators 0.9.0 trainer)")
    train.add_argument("run_dir", help="a run directory with finished hidden_states parts")
    train.add_argument("--out", help="output directory (default RUN_DIR/train; resumable)")
    train.add_argument("--verifier", help="target model directory (default: the one the states were extracted from)")
    train.add_argument("--epochs", type=int, default=3, help="passes over the training split")
    train.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (default: all epochs)")
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    train.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training (= K evaluated)")
    train.add_argument("--total-seq-len", type=int, default=2048, help="tokens per packed batch")
    train.add_argument("--draft-vocab-size", type=int, default=32000, help="0 = the target's full vocabulary")
    train.add_argument("--val-fraction", type=float, default=0.05, help="share of prompts held out (by hash)")
    train.add_argument("--seed", type=int, default=0, help="seed for the drafter's initialisation and data order")
    train.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        help="autocast dtype of the training step (default: bfloat16 on an accelerator or a CPU with bf16 "
        "instructions, float32 on other CPUs)",
    )
    train.add_argument("--no-evaluate", action="store_true", help="skip the acceptance evaluation afterwards")
    train.add_argument("--no-prefect", action="store_true", help="plain calls, no Prefect flow or artifacts")
    train.set_defaults(func=_user_errors(cmd_train))
    ev = sub.add_parser("evaluate", help="acceptance of a trained drafter on the run's held-out prompts")
    ev.add_argument("run_dir", help="a run directory with a trained drafter (train/)")
    ev.add_argument("--train-dir", help="default RUN_DIR/train")
    ev.add_argument("--max-new-tokens", type=int, default=96, help="tokens the target decodes per held-out prompt")
    ev.add_argument("--max-prompts", type=int, help="evaluate at most this many held-out prompts")
    ev.add_argument("--no-baseline", action="store_true", help="skip the untrained drafter's walk")
    ev.add_argument(
        "--prompts",
        metavar="FILE",
        help="walk exactly these prompts (JSONL/Parquet of messages or conversations) instead of the held-out split",
    )
    ev.add_argument("--no-prefect", action="store_true", help="plain calls, no Prefect flow or artifacts")
    ev.set_defaults(func=_user_errors(cmd_evaluate))


def _user_errors(command: Any) -> Any:
    """A missing `train` extra becomes a `ConfigError` naming the install; `flows.cli.main` prints it as one line with
    the user-error exit code, like the run-directory errors (`TrainError`, `ExportError`) the stages raise."""

    def run(args: argparse.Namespace) -> int:
        from tasks.common.errors import ConfigError

        try:
            result: int = command(args)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.split(".")[0] not in ("speculators", "hs_connectors", "datasets"):
                raise
            raise ConfigError(
                f"eagle3-datagen {args.command} needs the train extra ({exc.name} is not installed): "
                "pip install 'eagle3-datagen[train]'"
            ) from exc
        return result

    return run


def train_options(args: argparse.Namespace) -> Any:
    from tasks.train import TrainOptions

    return TrainOptions(
        epochs=args.epochs,
        max_steps=args.max_steps,
        lr=args.lr,
        ttt_steps=args.ttt_steps,
        total_seq_len=args.total_seq_len,
        draft_vocab_size=args.draft_vocab_size or None,
        val_fraction=args.val_fraction,
        seed=args.seed,
        verifier_path=args.verifier,
        hidden_states_dtype=args.dtype,
    )


def cmd_train(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    out = Path(args.out).resolve() if args.out else None
    options = train_options(args)
    from tasks.train.stage import hidden_states_provenance

    hidden_states_provenance(run_dir)  # a run directory with nothing to train on: one line, before Prefect starts
    if args.no_prefect:
        from tasks.evaluate import evaluate_run
        from tasks.train import train_run

        summary = train_run(run_dir, out, options)
        evaluation = None if args.no_evaluate else evaluate_run(run_dir, out)
    else:
        from flows.cli_common import prefect_env

        prefect_env()
        from flows.train_flow import train_flow

        result = train_flow(str(run_dir), str(out) if out else None, options.__dict__, evaluate=not args.no_evaluate)
        summary, evaluation = result["train"], result["evaluate"]
    print_train_result(summary, evaluation)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    train_dir = Path(args.train_dir).resolve() if args.train_dir else None
    kwargs: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "max_prompts": args.max_prompts,
        "baseline": not args.no_baseline,
    }
    if args.prompts:
        kwargs["prompts_file"] = str(Path(args.prompts).resolve())
        if not Path(kwargs["prompts_file"]).is_file():
            raise FileNotFoundError(f"--prompts {kwargs['prompts_file']}: no such file")
    from tasks.evaluate.stage import trained_summary_path

    trained_summary_path(run_dir, train_dir)  # nothing trained: one line, before Prefect starts
    if args.no_prefect:
        from tasks.evaluate import evaluate_run

        evaluation = evaluate_run(run_dir, train_dir, **kwargs)
    else:
        from flows.cli_common import prefect_env

        prefect_env()
        from flows.train_flow import evaluate_flow

        evaluation = evaluate_flow(str(run_dir), str(train_dir) if train_dir else None, kwargs)
    print_train_result(None, evaluation)
    return 0


def print_train_result(summary: dict[str, Any] | None, evaluation: dict[str, Any] | None) -> None:
    if summary is not None:
        last_val = summary["val_metrics"][-1] if summary["val_metrics"] else {}
        print(
            json.dumps(
                {
                    "checkpoint": summary["checkpoint"],
                    "steps": summary["steps"],
                    "train_s": summary["train_s"],
                    "val": {k: v for k, v in last_val.items() if k.startswith(("full_acc", "loss_epoch"))},
                },
                indent=2,
            )
        )
    if evaluation is not None:
        from tasks.evaluate import evaluation_markdown

        print(evaluation_markdown(evaluation))


def cmd_demo_train(args: argparse.Namespace) -> int:
    """The demo that learns: target-backed endpoint -> pipeline -> drafter -> acceptance, with stage wall times."""
    from flows.cli_common import demo_config_path, demo_dirs, prefect_env, print_demo_summary

    prefect_env()
    from endpoint_sim.model_backend import ModelResponder
    from endpoint_sim.server import SimConfig, SimulatorServer
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from flows.train_flow import train_flow
    from tasks.generate.progress_display import show_progress
    from tasks.train import TrainOptions

    run_dir, model_dir = demo_dirs(args)
    started = time.monotonic()
    sim_config = SimConfig(**DEMO_SIM_WORDS)
    responder = ModelResponder(model_dir, sim_config, temperature=0.0)
    with (
        SimulatorServer(model_dir, sim_config, responder=responder) as sim,
        show_progress(enabled=not args.no_progress, events=False),
    ):
        overrides = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(model_dir),
            **DEMO_TRAIN_OVERRIDES,
        }
        stats = pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides))
    pipeline_s = time.monotonic() - started
    print_demo_summary(stats, pipeline_s)
    result = train_flow(
        str(run_dir), None, TrainOptions(**DEMO_TRAIN).__dict__, evaluate=True, evaluate_kwargs=DEMO_EVAL
    )
    summary, evaluation = result["train"], result["evaluate"]
    print_train_result(summary, evaluation)
    walk, base = evaluation["walk"], evaluation["baseline"]
    print(
        f"\nwall times (s): pipeline (prepare..extract) {pipeline_s:.1f}, export {summary['export_s']:.1f}, "
        f"train {summary['train_s']:.1f}, evaluate {evaluation['wall_s']:.1f}"
    )
    print(
        f"drafter acceptance (K={walk['k']}): mean accepted length {walk['mean_accepted_length']:.2f} "
        f"(untrained {base['mean_accepted_length']:.2f}), tokens per verify step {walk['tokens_per_verify_step']:.2f}"
    )
    return 0

"""Prefect layer for the `train` and `evaluate` stages (the GPU pool's `train` deployment runs `train_flow`).

Thin: the work is `tasks.train.train_run` and `tasks.evaluate.evaluate_run`; the flows add retries-free tasks and
the metrics as artifacts (a table of the trainer's validation metrics per epoch, the acceptance report).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.artifact_keys import run_key
from flows.run_names import flow_run_name


@task(name="train-drafter")
def train_task(run_dir: str, out_dir: str | None, options: dict[str, Any]) -> dict[str, Any]:
    from pathlib import Path

    from tasks.train import TrainOptions, train_run

    summary = train_run(Path(run_dir), Path(out_dir) if out_dir else None, TrainOptions(**options))
    if summary["val_metrics"]:
        create_table_artifact(
            key=run_key("drafter-val-metrics", run_dir),
            table=summary["val_metrics"],
            description=f"speculators {summary['speculators_version']} validation metrics per epoch: "
            f"{summary['checkpoint']}",
        )
    if summary["train_metrics"]:
        every = max(1, len(summary["train_metrics"]) // 50)
        create_table_artifact(
            key=run_key("drafter-train-metrics", run_dir),
            table=summary["train_metrics"][::every],
            description="training metrics (every step up to 50 rows)",
        )
    return summary


@task(name="evaluate-drafter")
def evaluate_task(run_dir: str, train_dir: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    from pathlib import Path

    from tasks.evaluate import evaluate_run, evaluation_markdown

    options = dict(kwargs)
    if options.get("prompts_file"):
        options["prompts_file"] = Path(options["prompts_file"])
    result = evaluate_run(Path(run_dir), Path(train_dir) if train_dir else None, **options)
    create_markdown_artifact(key=run_key("drafter-acceptance", run_dir), markdown=evaluation_markdown(result))
    return result


# The docstrings' Args are the Run forms' field descriptions (Prefect reads them into the parameter schema): the
# train-gpu form showed bare labels where the pipeline's form (RunParameters' Field descriptions) explains each.
@flow(name="eagle3-evaluate", flow_run_name=flow_run_name)
def evaluate_flow(run_dir: str, train_dir: str | None = None, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure a trained drafter's acceptance on the held-out prompts (the `drafter-acceptance` artifact).

    Args:
        run_dir: The run directory holding the hidden states, as seen from the worker (e.g. runs/run).
        train_dir: The training output to evaluate; empty: <run_dir>/train.
        kwargs: Evaluation options, e.g. {"k": 3, "max_new_tokens": 96, "max_prompts": 50}; "prompts_file"
            (a dataset file, as seen from the worker) walks its prompts instead of the held-out ones; empty: the
            drafter's ttt_steps, 96 new tokens, every held-out prompt.
    """
    result: dict[str, Any] = evaluate_task(run_dir, train_dir, kwargs or {})
    return result


@flow(name="eagle3-train", flow_run_name=flow_run_name)  # `train-<run dir>-<6 hex>`
def train_flow(
    run_dir: str,
    out_dir: str | None = None,
    options: dict[str, Any] | None = None,
    evaluate: bool = True,
    evaluate_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train a drafter on `run_dir` (resumable), then measure its acceptance on the held-out prompts.

    Args:
        run_dir: The run directory holding the hidden states, as seen from the worker (e.g. runs/run).
        out_dir: Where the export, checkpoints and train_summary.json go; empty: <run_dir>/train.
        options: Trainer options, e.g. {"epochs": 3, "lr": 0.001, "ttt_steps": 3, "max_steps": 100}
            (tasks/train/stage.py TrainOptions); empty: its defaults.
        evaluate: Measure the drafter's acceptance on the held-out prompts after training.
        evaluate_kwargs: Evaluation options, as the evaluate flow's kwargs (e.g. {"max_prompts": 50}).
    """
    summary = train_task(run_dir, out_dir, options or {})
    evaluation = evaluate_task(run_dir, out_dir, evaluate_kwargs or {}) if evaluate else None
    return {"train": summary, "evaluate": evaluation}

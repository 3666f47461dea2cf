"""The `evaluate` stage: the trained drafter's acceptance on the run's held-out prompts.

Held-out = the validation rows of the trainer's own split: the prompts the export held out (by prompt hash),
written after the training rows, i.e. the rows past `train_data_ratio` that its `val_epoch` reads; or, with
`prompts_file` (`evaluate --prompts FILE`), exactly the prompts of that JSONL/Parquet file (OpenAI `messages` or
ShareGPT `conversations` rows, a trailing assistant turn dropped), rendered with the run's tokenizer and chat
template: a held-out set of its own, as large as the figure needs. For those prompts it reports

- `walk`: greedy chain verification along the target's greedy decode from each row's prompt (everything before
  the row's first loss-masked token): mean accepted length, tokens per verify step, per-position acceptance;
- `baseline`: the same walk for an untrained drafter (same config and vocab, decoder weights re-initialised with
  the model's own initialiser, fixed seed), the floor a trained drafter must clear;
- `teacher_forced`: speculators' validation metric (`full_acc_k`) recomputed on the same rows, and `cross_check`:
  its largest absolute difference from the trainer's last logged `full_acc_k_epoch`, against `TOLERANCE`.

Results go to `<train_dir>/evaluation.json`, a section of the validation report, and (from the flow) a Prefect
artifact.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from tasks.common.shards import atomic_write_text, done_parts, read_provenance
from tasks.common.torch_threads import torch_threads
from tasks.evaluate.acceptance import Drafter, Target, acceptance_walk, teacher_forced
from tasks.evaluate.interval import format_interval
from tasks.train.stage import EXPORT_DIR, SUMMARY_NAME, TrainError, hidden_states_provenance

EVALUATION_NAME = "evaluation.json"
TOLERANCE = 0.03
"""Absolute tolerance between the trainer's `full_acc_k_epoch` and ours: the trainer may run its forward under bf16
autocast and computes targets from the stored (bf16) final states, we run the drafter in fp32 against the live
target's logits, so near-tied argmaxes can flip on a few positions; on the demo's few thousand positions that is
well under 3 points, while any indexing or masking error moves the figure by far more."""


def heldout_rows(export_dir: Path, train_data_ratio: float) -> list[tuple[list[int], list[int]]]:
    from datasets import load_from_disk

    data = load_from_disk(str(export_dir))
    split = int(len(data) * train_data_ratio)
    held = data.select(range(split, len(data)))
    return [(list(map(int, r["input_ids"])), list(map(int, r["loss_mask"]))) for r in held]


def prompts_from_file(run_dir: Path, path: Path, target_dir: Path) -> list[list[int]]:
    """The prompt ids of every row of `path`, rendered as the run rendered its own prompts (its tokenizer and
    chat-template kwargs, from the run's tokens provenance; the target's own directory when that names none); a
    malformed row is an error naming its row."""
    from tasks.common.config import DatasetConfig, TokenizerConfig
    from tasks.common.errors import ConfigError
    from tasks.prepare.datasets import MalformedRow, _raw_rows, normalize_row
    from tasks.reconstruct.tokenizer_loading import load_tokenizer, render_prompt_ids

    if not Path(path).is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    refs = done_parts(run_dir, "tokens")
    prov = read_provenance(refs[0].path) if refs else {}
    tokenizer = load_tokenizer(
        TokenizerConfig(
            path=Path(prov.get("tokenizer_path") or target_dir),
            trust_remote_code=bool(prov.get("tokenizer_trust_remote_code")),
        )
    )
    kwargs = prov.get("chat_template_kwargs") or {}
    prompts = []
    for row_no, row, error in _raw_rows(DatasetConfig(name="heldout", path=Path(path))):
        try:
            if error is not None:
                raise MalformedRow(error)
            messages = normalize_row(row, "auto")
        except MalformedRow as exc:
            raise ConfigError(f"--prompts {path}: row {row_no}: {exc}") from exc
        prompts.append(render_prompt_ids(tokenizer, messages, kwargs))
    if not prompts:
        raise ConfigError(f"--prompts {path} holds no prompt")
    return prompts


def prompt_of(ids: list[int], mask: list[int]) -> list[int]:
    first = next((i for i, v in enumerate(mask) if v), len(ids))
    return ids[:first]


def untrained_like(drafter: Drafter, seed: int = 0) -> Drafter:
    """Same config, vocab maps and verifier weights; the trainable decoder re-initialised."""
    import copy

    model = copy.deepcopy(drafter.model)
    torch.manual_seed(seed)
    for module in (model.fc, model.layers, model.lm_head, model.norm):
        module.apply(model._init_weights)
    return Drafter(model)


def trainer_full_acc(summary: dict[str, Any], k: int) -> list[float] | None:
    val = summary.get("val_metrics") or []
    if not val:
        return None
    last = val[-1]
    return [float(last.get(f"full_acc_{j}_epoch", float("nan"))) for j in range(k)]


def trained_summary_path(run_dir: Path, train_dir: Path | None = None) -> Path:
    """The drafter's `train_summary.json`; checked before anything starts (the CLI checks it before Prefect)."""
    train_dir = Path(train_dir or Path(run_dir) / "train").resolve()
    summary_path = train_dir / SUMMARY_NAME
    if not summary_path.is_file():
        raise TrainError(f"{train_dir} has no {SUMMARY_NAME}: run `eagle3-datagen train {run_dir}` first")
    return summary_path


def evaluate_run(
    run_dir: Path,
    train_dir: Path | None = None,
    *,
    k: int | None = None,
    max_new_tokens: int = 96,
    max_prompts: int | None = None,
    baseline: bool = True,
    prompts_file: Path | None = None,
) -> dict[str, Any]:
    """`prompts_file`: walk exactly the prompts of this file instead of the trainer's held-out rows (the
    teacher-forced cross-check still reads the trainer's held-out rows, as its own metric does)."""
    run_dir = Path(run_dir).resolve()
    train_dir = Path(train_dir or run_dir / "train").resolve()
    summary = json.loads(trained_summary_path(run_dir, train_dir).read_text())
    opts = summary["options"]
    k = k or int(opts["ttt_steps"])
    started = time.monotonic()
    rows = heldout_rows(train_dir / EXPORT_DIR, float(summary["train_data_ratio"]))
    prompts = prompts_from_file(run_dir, prompts_file, Path(summary["verifier"])) if prompts_file else None
    with torch_threads(1):
        result = _evaluate(run_dir, summary, rows, prompts, max_prompts, k, max_new_tokens, baseline, started)
    if prompts_file is not None:
        result["prompts_file"] = str(prompts_file)
    atomic_write_text(train_dir / EVALUATION_NAME, json.dumps(result, indent=2))
    from tasks.validate.sections import add_report_section

    add_report_section(run_dir, "drafter-acceptance", evaluation_markdown(result))
    return result


def _evaluate(
    run_dir: Path,
    summary: dict[str, Any],
    rows: list[tuple[list[int], list[int]]],
    file_prompts: list[list[int]] | None,
    max_prompts: int | None,
    k: int,
    max_new_tokens: int,
    baseline: bool,
    started: float,
) -> dict[str, Any]:
    prov = hidden_states_provenance(run_dir)
    target = Target.load(summary["verifier"], prov.get("extract_layers"), str(prov.get("extract_dtype", "bfloat16")))
    drafter = Drafter.load(summary["checkpoint"])
    # the walks decode from (up to max_prompts of) the held-out prompts; the cross-check reads every held-out row,
    # like the trainer's own validation epoch
    if file_prompts is not None:
        prompts = file_prompts[:max_prompts]
    else:
        prompts = [prompt_of(ids, mask) for ids, mask in rows[:max_prompts]]
    walk = acceptance_walk(target, drafter, prompts, k, max_new_tokens)
    walk_s = time.monotonic() - started
    base = acceptance_walk(target, untrained_like(drafter), prompts, k, max_new_tokens) if baseline else None
    forced = teacher_forced(target, drafter, rows, k)
    trainer = trainer_full_acc(summary, k)
    diff = max(abs(a - b) for a, b in zip(forced["full_acc"], trainer, strict=True)) if trainer else None
    result = {
        "run_dir": str(run_dir),
        "checkpoint": summary["checkpoint"],
        "heldout_rows": len(rows),
        "heldout_prompts_walked": len(prompts),
        "heldout_source": "prompts_file" if file_prompts is not None else "trainer_validation_split",
        "walked_prompts": prompts,
        "k": k,
        "max_new_tokens": max_new_tokens,
        "walk": walk,
        "baseline": base,
        "teacher_forced": forced,
        "cross_check": {
            "trainer_full_acc": trainer,
            "evaluate_full_acc": forced["full_acc"],
            "max_abs_diff": diff,
            "tolerance": TOLERANCE,
            "agrees": diff is not None and diff <= TOLERANCE,
        },
        "walk_s": round(walk_s, 3),
        "wall_s": round(time.monotonic() - started, 3),
    }
    return result


def _fmt(values: list[float] | None) -> str:
    return ", ".join(f"{v:.3f}" for v in values) if values else "n/a"


def _interval(walk: dict[str, Any]) -> str:
    """The walk's mean accepted length as other prompts of the same kind could have given it (a bootstrap over
    the walked prompts, `tasks.evaluate.interval`)."""
    interval = walk.get("mean_accepted_length_interval_95")
    return format_interval(interval[0], interval[1], digits=3) if interval else "n/a"


def evaluation_markdown(result: dict[str, Any]) -> str:
    walk, base, cross = result["walk"], result["baseline"], result["cross_check"]
    lines = [
        "## Drafter acceptance (held-out prompts)",
        "",
        f"Drafter `{result['checkpoint']}`, K = {result['k']}, greedy chain verification along the target's greedy "
        f"decode of {walk['prompts']} held-out prompts ({walk['generated_tokens']} tokens, "
        f"{walk['verify_steps']} verify steps).",
        "",
        "| drafter | mean accepted length | 95% interval over prompts | tokens per verify step | "
        "per-position acceptance |",
        "|---|---:|---:|---:|---|",
        f"| trained | {walk['mean_accepted_length']:.3f} | {_interval(walk)} | {walk['tokens_per_verify_step']:.3f} | "
        f"{_fmt(walk['per_position_acceptance'])} |",
    ]
    if base:
        lines.append(
            f"| untrained | {base['mean_accepted_length']:.3f} | {_interval(base)} | "
            f"{base['tokens_per_verify_step']:.3f} | {_fmt(base['per_position_acceptance'])} |"
        )
    lines += [
        "",
        f"Cross-check with the trainer's own validation metric (full_acc per draft position, same rows): trainer "
        f"{_fmt(cross['trainer_full_acc'])}, evaluate {_fmt(cross['evaluate_full_acc'])}; max |diff| "
        f"{cross['max_abs_diff'] if cross['max_abs_diff'] is None else round(cross['max_abs_diff'], 4)} "
        f"(tolerance {cross['tolerance']}): {'agrees' if cross['agrees'] else 'DOES NOT AGREE'}.",
    ]
    return "\n".join(lines)

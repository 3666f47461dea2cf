"""The data-quality proof: a drafter trained on the target's own answers against one trained on other answers.

Two run directories over the same prompts (the bundled demo datasets), identical but for who wrote the answers:

- `regenerated`: the local endpoint backed by the target model itself (`endpoint_sim.model_backend`, greedy), i.e.
  what this tool produces: the target's own responses, tokenized as the target saw them;
- `original`: the endpoint's stock text generator, standing in for the answers a dataset ships with (written by
  some other model or person; the bundled demo files carry only placeholder answers).

Both go through the same pipeline (prepare, generate, reconstruct, validate, extract), and drafters are trained
with speculators' trainer on each with the same token budget (the same number of optimizer steps over packed
batches of the same `total_seq_len`; the non-padding tokens actually trained on are printed too), the same seed
and options. Both are evaluated on the same held-out prompts (the trainer's validation split, identical in the
two runs) with the acceptance walk: the target's greedy decode, K drafts per verify step, greedy chain
verification.

Prints both acceptance lengths side by side and their ratio. CPU, a few minutes:
    python bench/ab_regenerated_vs_original.py [--out runs/ab] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build_run(name: str, out: Path, model_dir: Path, model_backed: bool) -> float:
    from endpoint_sim.model_backend import ModelResponder
    from endpoint_sim.server import SimConfig, SimulatorServer
    from flows.cli import demo_config_path
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from flows.train_cli import DEMO_SIM_WORDS, DEMO_TRAIN_OVERRIDES

    run_dir = out / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    sim_config = SimConfig(**DEMO_SIM_WORDS) if model_backed else SimConfig()
    responder = ModelResponder(model_dir, sim_config, temperature=0.0) if model_backed else None
    started = time.monotonic()
    with SimulatorServer(model_dir, sim_config, responder=responder) as sim:
        overrides = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(model_dir),
            **DEMO_TRAIN_OVERRIDES,
        }
        pipeline(RunParameters(config_path=str(demo_config_path()), overrides=overrides))
    return time.monotonic() - started


def train_and_evaluate(run_dir: Path, steps: int, max_prompts: int, max_new_tokens: int) -> dict[str, Any]:
    from tasks.evaluate import evaluate_run
    from tasks.evaluate.stage import heldout_rows, prompt_of
    from tasks.train import TrainOptions, train_run

    options = TrainOptions(
        epochs=1000, max_steps=steps, lr=3e-3, total_seq_len=1024, draft_vocab_size=4096, seed=0, val_fraction=0.1
    )
    summary = train_run(run_dir, run_dir / "train", options)
    evaluation = evaluate_run(run_dir, run_dir / "train", max_new_tokens=max_new_tokens, max_prompts=max_prompts)
    rows = heldout_rows(run_dir / "train" / "export", summary["train_data_ratio"])[:max_prompts]
    return {
        "summary": summary,
        "evaluation": evaluation,
        "prompts": [prompt_of(ids, mask) for ids, mask in rows],
        "budget_tokens": steps * options.total_seq_len,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "ab"))
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps for each drafter (same budget)")
    parser.add_argument("--max-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")
    from endpoint_sim.assets import ensure_tiny_model_dir

    out = Path(args.out).resolve()
    model_dir = ensure_tiny_model_dir(out / "_assets" / "tiny-deepseek-v31")
    results: dict[str, dict[str, Any]] = {}
    for name, model_backed in (("regenerated", True), ("original", False)):
        pipeline_s = build_run(name, out, model_dir, model_backed)
        result = train_and_evaluate(out / name, args.steps, args.max_prompts, args.max_new_tokens)
        result["pipeline_s"] = pipeline_s
        results[name] = result
    if results["regenerated"]["prompts"] != results["original"]["prompts"]:
        raise SystemExit("the two runs' held-out prompts differ; the comparison would not be like for like")
    rows = []
    for name, r in results.items():
        walk, val = r["evaluation"]["walk"], r["summary"]["val_metrics"][-1]
        rows.append(
            {
                "answers": name,
                "budget_tokens": r["budget_tokens"],
                "train_tokens": r["summary"]["train_tokens"],
                "steps": r["summary"]["steps"],
                "mean_accepted_length": round(walk["mean_accepted_length"], 3),
                "tokens_per_verify_step": round(walk["tokens_per_verify_step"], 3),
                "per_position_acceptance": [round(x, 3) for x in walk["per_position_acceptance"]],
                "untrained_mean_accepted_length": round(r["evaluation"]["baseline"]["mean_accepted_length"], 3),
                "trainer_val_full_acc_0": round(val.get("full_acc_0_epoch", float("nan")), 3),
                "pipeline_s": round(r["pipeline_s"], 1),
                "train_s": r["summary"]["train_s"],
                "evaluate_s": r["evaluation"]["wall_s"],
            }
        )
    print(json.dumps(rows, indent=2))
    reg, orig = rows[0]["mean_accepted_length"], rows[1]["mean_accepted_length"]
    k = results["regenerated"]["evaluation"]["k"]
    print(
        f"\nK={k}, same budget of {rows[0]['budget_tokens']} tokens ({args.steps} packed batches) each (trained on "
        f"{rows[0]['train_tokens']} vs {rows[1]['train_tokens']} non-padding tokens), same "
        f"{len(results['original']['prompts'])} "
        f"held-out prompts:\n  accepted drafts per verify step: regenerated {reg:.3f} vs original {orig:.3f} "
        f"({f'ratio {reg / orig:.1f}x' if orig else 'the original-answers drafter accepts none'})\n"
        f"  tokens per verify step: regenerated "
        f"{rows[0]['tokens_per_verify_step']:.3f} vs original {rows[1]['tokens_per_verify_step']:.3f}"
    )
    (out / "ab_result.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

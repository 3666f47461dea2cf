"""Does storing the model's exact ids matter? Two drafters, same answers, same budget: exact ids vs re-encoded text.

The seed judged re-encoding "totally fine" because the decoded text is the same. On SmolLM2-135M-Instruct it is
not the same sequence: the model writes `ĊĊ` (one token) at a paragraph break where re-encoding the text gives
`Ċ Ċ`, `je ur` where it gives `j eur`, so a drafter trained on re-encoded ids learns splits the target never
emits. This script measures what that costs:

1. `exact`: the target answers the real-model demo's prompts through the local endpoint (greedy, SGLang's
   /generate shape), and the run stores the model's ids (`reconstruct.token_ids: model`); with `--from RUN_DIR`
   an existing such run (e.g. `runs/demo-real/own`) is used instead;
2. `reencoded`: a copy of the same prompts and responses (the very same answers, nothing generated again),
   reconstructed with `reconstruct.token_ids: reencode`, then validated and extracted;
3. both drafters trained with speculators' trainer with the same options and budget (optimizer steps over packed
   batches of the same length, same seed), and walked along the target's greedy decode of the same held-out
   prompt file (`evaluate --prompts`).

Prints one JSON line: accepted drafts per verify step of each, their ratio with its 95% interval over the held-out
prompts (paired bootstrap, `tasks.evaluate.interval`), the held-out target tokens walked,
how many stored rows and tokens differ between the two runs, and the repair for text-only endpoints
(`reconstruct.repair_from`) measured on answers its rules were not learned from: rows whose repaired re-encoding
equals the model's ids, against rows whose plain re-encoding does. CPU, 6 minutes on 2 cores with --from (366 s
measured); without it the answers are generated first (~5 minutes more):
    python bench/exact_vs_reencoded.py [--out runs/bench-exact] [--from runs/demo-real/own]
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def pipeline_run(run_dir: Path, model_dir: Path, responder: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    from endpoint_sim.server import SimulatorServer
    from flows.params import RunParameters
    from flows.pipeline import pipeline
    from flows.real_demo import real_config_path

    with SimulatorServer(model_dir, responder.config, responder=responder) as sim:
        settings = {
            "run_dir": str(run_dir),
            "endpoint.base_url": sim.base_url,
            "tokenizer.path": str(model_dir),
            **overrides,
        }
        stats: dict[str, Any] = pipeline(RunParameters(config_path=str(real_config_path()), overrides=settings))
    return stats


def copy_answers(source: Path, target: Path) -> None:
    """The same prompts and responses parts (files and completion markers): nothing is generated again."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for stage in ("prompts", "responses"):
        shutil.copytree(source / stage, target / stage, ignore=shutil.ignore_patterns("_chunks", "_journal"))
    if (source / "spend").is_dir():
        shutil.copytree(source / "spend", target / "spend")


def _edits(ours: list[int], model: list[int]) -> tuple[int, int]:
    """(places where the two id sequences differ, model tokens inside those places), aligned with difflib."""
    ops = difflib.SequenceMatcher(a=ours, b=model, autojunk=False).get_opcodes()
    changed = [(j1, j2) for op, _, _, j1, j2 in ops if op != "equal"]
    return len(changed), sum(j2 - j1 for j1, j2 in changed)


def differing(exact: Path, reencoded: Path) -> dict[str, int]:
    from tasks.common.shards import done_parts, read_part

    ids: dict[str, list[int]] = {}
    for ref in done_parts(exact, "tokens"):
        for row in read_part(ref, columns=["sample_id", "input_ids"]).to_pylist():
            ids[row["sample_id"]] = row["input_ids"]
    rows = places = tokens = total = 0
    for ref in done_parts(reencoded, "tokens"):
        for row in read_part(ref, columns=["sample_id", "input_ids"]).to_pylist():
            model = ids[row["sample_id"]]
            total += len(model)
            if model != row["input_ids"]:
                rows += 1
                where, inside = _edits(row["input_ids"], model)
                places, tokens = places + where, tokens + inside
    return {
        "rows": len(ids),
        "rows_differing": rows,
        "places": places,
        "model_tokens_in_places": tokens,
        "tokens": total,
    }


def repair_exactness(exact: Path, model_dir: Path) -> dict[str, Any]:
    """The repair for text-only endpoints, measured without leakage: rules learned from every other answer of the
    exact run (the even rows), applied to the re-encoding of the others, compared with the model's ids there."""
    from tasks.common.config import TokenizerConfig
    from tasks.common.shards import done_parts
    from tasks.reconstruct.completion_format import derive_format
    from tasks.reconstruct.repair import RepairTable, reference_pairs
    from tasks.reconstruct.tokenizer_backend import backend_for
    from tasks.reconstruct.tokenizer_loading import load_tokenizer

    tokenizer = load_tokenizer(TokenizerConfig(path=model_dir))
    backend, fmt = backend_for(tokenizer), derive_format(tokenizer)
    pairs = reference_pairs(done_parts(exact, "responses"), backend, fmt)
    table = RepairTable.learn(backend, pairs[0::2])
    rows = reencoded_exact = repaired_exact = reencoded_places = repaired_places = 0
    for ours, model in pairs[1::2]:
        fixed, _ = table.apply(backend, ours)
        rows += 1
        reencoded_exact += ours == model
        repaired_exact += fixed == model
        reencoded_places += _edits(ours, model)[0]
        repaired_places += _edits(fixed, model)[0]
    return {
        "learned_from_rows": len(pairs[0::2]),
        "rules": table.describe(backend),
        "rows": rows,
        "reencoded_rows_exact": reencoded_exact,
        "repaired_rows_exact": repaired_exact,
        "reencoded_places_differing": reencoded_places,
        "repaired_places_differing": repaired_places,
    }


def _quick_demo_run(run_dir: Path) -> bool:
    """`make bench-real` reuses runs/demo-real/own whatever made it; trained at the full budget on a --quick run's
    few short answers, the two drafters would print a figure of nothing."""
    summary = run_dir.resolve().parent / "demo_real.json"
    return summary.is_file() and bool(json.loads(summary.read_text()).get("quick"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-exact"))
    parser.add_argument("--from", dest="source", help="an existing exact-ids run of the real-model config")
    parser.add_argument("--assets-dir", default=str(REPO / "runs" / "_assets"))
    parser.add_argument("--steps", type=int, help="optimizer steps per drafter (default: the demo's budget)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the demo's --quick sizes: a smoke run, not a figure")
    args = parser.parse_args()
    if args.source and not args.quick and _quick_demo_run(Path(args.source)):
        print(
            f"error: {args.source} is a `demo --real --quick` run (24 short answers): pass --quick to smoke-test on "
            "it, or rerun `make demo-real` for a figure",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")
    from endpoint_sim.model_backend import ModelResponder
    from endpoint_sim.responder import Responder, SimConfig
    from endpoint_sim.smollm2 import DIR_NAME, ensure_smollm2_dir
    from flows.real_demo import QUICK, REAL_BATCH, REAL_EVAL, REAL_TRAIN, heldout_prompts_path, quick_overrides
    from tasks.evaluate import evaluate_run
    from tasks.evaluate.acceptance import shared_targets
    from tasks.evaluate.interval import paired_ratio_interval
    from tasks.train import TrainOptions, train_run

    started = time.monotonic()
    out = Path(args.out).resolve()
    model_dir = ensure_smollm2_dir(Path(args.assets_dir).resolve() / DIR_NAME)
    sim_config = SimConfig(model_name="sim/smollm2-135m-instruct", providers=("SimLocal",))
    exact = Path(args.source).resolve() if args.source else out / "exact"
    if args.quick and not args.source:
        raise SystemExit("--quick measures an existing run: pass --from runs/demo-real/own (demo --real --quick)")
    if not args.source:
        own = ModelResponder(model_dir, sim_config, temperature=0.0, batch_size=REAL_BATCH, torch_threads=args.threads)
        pipeline_run(exact, model_dir, own, {})
    reencoded = out / "reencoded"
    copy_answers(exact, reencoded)
    sizes = quick_overrides() if args.quick else {}
    pipeline_run(reencoded, model_dir, Responder(model_dir, sim_config), {**sizes, "reconstruct.token_ids": "reencode"})
    pipelines_s = time.monotonic() - started

    train, evaluate = dict(REAL_TRAIN), dict(REAL_EVAL)
    if args.quick:
        train.update(max_steps=QUICK["max_steps"], val_fraction=QUICK["val_fraction"])
        evaluate = {"max_new_tokens": QUICK["max_new_tokens"], "max_prompts": QUICK["heldout"]}
    options = TrainOptions(**{**train, **({"max_steps": args.steps} if args.steps else {})})
    result: dict[str, Any] = {"bench": "exact_vs_reencoded", "target": "SmolLM2-135M-Instruct"}
    per_prompt: dict[str, list[list[int]]] = {}
    with shared_targets():  # the second drafter walks the first one's target decodes of the held-out prompts
        for name, run_dir in (("exact", exact), ("reencoded", reencoded)):
            summary = train_run(run_dir, run_dir / "train", options)
            evaluation = evaluate_run(
                run_dir, run_dir / "train", prompts_file=heldout_prompts_path(), baseline=False, **evaluate
            )
            walk = evaluation["walk"]
            per_prompt[name] = walk["per_prompt"]
            last_val = summary["val_metrics"][-1] if summary["val_metrics"] else {}
            result[name] = {
                "accepted_per_verify_step": round(walk["mean_accepted_length"], 4),
                "tokens_per_verify_step": round(walk["tokens_per_verify_step"], 4),
                "per_position_acceptance": [round(x, 4) for x in walk["per_position_acceptance"]],
                "verify_steps": walk["verify_steps"],
                "train_tokens": summary["train_tokens"],
                "trainer_val_full_acc_0": round(last_val.get("full_acc_0_epoch", float("nan")), 4),
            }
            result["heldout_prompts"] = walk["prompts"]
            result["heldout_tokens"] = walk["generated_tokens"]
    a, b = result["exact"]["accepted_per_verify_step"], result["reencoded"]["accepted_per_verify_step"]
    result["exact_over_reencoded"] = round(a / b, 4) if b else None
    low, high = paired_ratio_interval(per_prompt["exact"], per_prompt["reencoded"])
    result["exact_over_reencoded_interval_95_over_heldout_prompts"] = [round(low, 4), round(high, 4)]
    result["budget"] = {"max_steps": options.max_steps, "total_seq_len": options.total_seq_len, "k": options.ttt_steps}
    result["stored_ids"] = differing(exact, reencoded)
    result["repair_on_unseen_answers"] = repair_exactness(exact, model_dir)
    result["wall_s"] = {"pipelines": round(pipelines_s, 1), "total": round(time.monotonic() - started, 1)}
    (out / "exact_vs_reencoded.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "exact_vs_reencoded.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

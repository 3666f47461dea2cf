"""How much of the real-model demo's own/other figure is the training seed? Both drafters retrained per seed.

`make demo-real` trains one drafter on SmolLM2-135M-Instruct's own answers and one on other answers of the same
length, with seed 0, and prints their ratio with an interval over the held-out prompts. That interval leaves out
what training itself adds: another seed moves the own drafter by about 0.05 accepted drafts per verify step. This
script retrains both drafters for each seed on copies of the demo's two run directories (the same answers, ids
and hidden states: nothing is generated or extracted again), with the demo's budget, and walks every drafter along
the same target decodes of the same held-out prompt file.

Prints one JSON line: per seed, own and other accepted drafts per verify step and their ratio with its 95%
interval over the held-out prompts; and over all seeds pooled (each prompt's accepted drafts and verify steps
summed over the seeds, so the ratio is the seeds' total, and the paired bootstrap redraws prompts with every
seed's walk of them). Seed 0 repeats the demo's own training, so its row must equal `demo_real.json`'s figures.
CPU, 593 s for three seeds on 2 cores (the first walk decodes the target's answers, ~30 s, the rest reuse them):
    python bench/own_vs_other_seeds.py [--from runs/demo-real] [--seeds 0 1 2] [--out runs/bench-seeds]
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

ARMS = ("own", "other")


def copy_run(source: Path, target: Path) -> None:
    """Every stage but the drafter: evaluating writes a report section into its run directory, and the demo's
    own report must keep the demo's figures."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("train", "_chunks", "_journal"))


def pooled(walks: list[list[list[int]]]) -> list[list[int]]:
    """Each prompt's [accepted drafts, verify steps] summed over several walks of the same prompts."""
    return [[sum(w[p][0] for w in walks), sum(w[p][1] for w in walks)] for p in range(len(walks[0]))]


def ratio_row(own: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    from tasks.evaluate.interval import paired_ratio_interval

    def rate(walk: list[list[int]]) -> float:
        steps = sum(s for _, s in walk)
        return sum(a for a, _ in walk) / steps if steps else 0.0

    low, high = paired_ratio_interval(own, other)
    return {
        "own": round(rate(own), 4),
        "other": round(rate(other), 4),
        "own_over_other": round(rate(own) / rate(other), 3) if rate(other) else None,
        "interval_95_over_heldout_prompts": [round(low, 3), round(high, 3)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", default=str(REPO / "runs" / "demo-real"))
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-seeds"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    source = Path(args.source).resolve()
    summary_path = source / "demo_real.json"
    if not all((source / arm / "hidden_states").is_dir() for arm in ARMS) or not summary_path.is_file():
        print(f"error: {source} holds no finished `make demo-real` (own/ and other/): run it first", file=sys.stderr)
        return 2
    demo = json.loads(summary_path.read_text())
    if demo.get("quick"):
        print(f"error: {source} is a `demo --real --quick` run, not a figure: rerun `make demo-real`", file=sys.stderr)
        return 2
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.real_demo import REAL_EVAL, REAL_TRAIN, heldout_prompts_path
    from tasks.evaluate import evaluate_run
    from tasks.evaluate.acceptance import shared_targets
    from tasks.train import TrainOptions, train_run

    started = time.monotonic()
    out = Path(args.out).resolve()
    runs = {arm: out / arm for arm in ARMS}
    for arm, run_dir in runs.items():
        copy_run(source / arm, run_dir)
    walks: dict[str, list[list[list[int]]]] = {arm: [] for arm in ARMS}
    per_seed: list[dict[str, Any]] = []
    heldout: dict[str, int] = {}
    with shared_targets():  # every drafter walks the first one's target decodes of the held-out prompts
        for seed in args.seeds:
            options = TrainOptions(**{**REAL_TRAIN, "seed": seed})
            for arm, run_dir in runs.items():
                train_dir = out / f"seed-{seed}" / arm
                train_run(run_dir, train_dir, options)
                walk = evaluate_run(
                    run_dir, train_dir, prompts_file=heldout_prompts_path(), baseline=False, **REAL_EVAL
                )["walk"]
                walks[arm].append(walk["per_prompt"])
                heldout = {"prompts": walk["prompts"], "target_tokens": walk["generated_tokens"]}
            per_seed.append({"seed": seed, **ratio_row(walks["own"][-1], walks["other"][-1])})
            print(json.dumps(per_seed[-1]), file=sys.stderr, flush=True)
    result = {
        "bench": "own_vs_other_seeds",
        "target": "SmolLM2-135M-Instruct",
        "k": demo["k"],
        "heldout": heldout,
        "budget": {k: REAL_TRAIN[k] for k in ("max_steps", "total_seq_len", "draft_vocab_size")},
        "demo_seed_0": demo["accepted_per_verify_step"],
        "per_seed": per_seed,
        "pooled_over_seeds": ratio_row(pooled(walks["own"]), pooled(walks["other"])),
        "seeds_reaching_3x": sum(1 for row in per_seed if (row["own_over_other"] or 0) >= 3),
        "wall_s": round(time.monotonic() - started, 1),
    }
    (out / "own_vs_other_seeds.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two settings of the real-model demo, each measured against its alternative side by side.

On SmolLM2-135M-Instruct (`make demo-real`'s target), each pair measured in one run, alternating, same inputs:

1. `generate`: the model-backed endpoint's decode (`ModelResponder`, greedy, the demo's 64-token answers) of the
   same training prompts at batch 16 and batch 48 (the demo's `REAL_BATCH`), tokens per second;
2. `train`: speculators' own training step on a finished demo run (`--from`, default `runs/demo-real/own`) under
   CPU autocast to bf16 and in float32 (the trainer's `hidden_states_dtype`), median step milliseconds; which one
   `cpu_train_dtype()` picks on this machine (bf16 only with AMX or AVX512-BF16) is printed with them. Both arms
   run Muon's orthogonalization as the CPU trainer does on this machine (in float32 without bf16 instructions),
   so the pair differs in the autocast dtype only;
3. `evaluate`: the target's greedy decode (48 tokens) of the held-out prompts (`flows/data/real_heldout.jsonl`)
   that the acceptance walk follows, one prompt at a time (`Target.greedy`) and batched (`Target.decode_all`,
   each decode checked against the target's own forward pass), seconds, and how many decodes are identical.

Prints one JSON line with the figures and the ratios. CPU, ~8 minutes on 2 idle cores:
    python bench/real_demo_speed.py [--from runs/demo-real/own] [--prompts 48] [--steps 8] [--heldout 48]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def prompt_messages(path: Path, n: int) -> list[list[dict[str, Any]]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines()[:n]]


def generate_tok_s(model_dir: Path, model: Any, prompts: list[tuple[int, ...]], batch: int, threads: int) -> float:
    from endpoint_sim.model_backend import ModelResponder
    from endpoint_sim.responder import SimConfig

    responder = ModelResponder(
        model_dir, SimConfig(providers=("bench",)), batch_size=batch, torch_threads=threads, model=model
    )
    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: responder.sample(p, None, None, 64), prompts))
    return sum(len(a.output_ids) for a in answers) / (time.monotonic() - started)


def train_step_ms(run_dir: Path, dtype: str, steps: int) -> float:
    from flows.real_demo import REAL_TRAIN
    from tasks.train import TrainOptions, train_run

    out = Path(tempfile.mkdtemp(prefix=f"bench-train-{dtype}-"))
    try:
        options = TrainOptions(**{**REAL_TRAIN, "max_steps": steps, "hidden_states_dtype": dtype})
        summary = train_run(run_dir, out, options)
        return float(summary["step_ms_median"])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def heldout_decode_s(run_dir: Path, model_dir: Path, n: int) -> dict[str, Any]:
    """Seconds to decode `n` held-out prompts one at a time, then batched, each on a freshly loaded target (its
    decodes are kept per target), and how many of the two decodes of a prompt are the same ids."""
    from flows.real_demo import REAL_EVAL, heldout_prompts_path
    from tasks.common.torch_threads import torch_threads
    from tasks.evaluate.acceptance import Target
    from tasks.evaluate.stage import prompts_from_file
    from tasks.train.stage import hidden_states_provenance

    prov = hidden_states_provenance(run_dir)
    prompts = prompts_from_file(run_dir, heldout_prompts_path(), model_dir)[:n]
    tokens = int(REAL_EVAL["max_new_tokens"])

    def load() -> Target:
        return Target.load(model_dir, prov.get("extract_layers"), str(prov.get("extract_dtype", "float32")))

    with torch_threads(1):  # as `evaluate_run` runs its walks; `decode_all` widens it for its batches
        single = load()
        started = time.monotonic()
        one_by_one = [single.greedy(p, tokens) for p in prompts]
        single_s = time.monotonic() - started
        batched = load()
        started = time.monotonic()
        counts = batched.decode_all(prompts, tokens)
        batched_s = time.monotonic() - started
    same = sum(batched.greedy(p, tokens) == seq for p, seq in zip(prompts, one_by_one, strict=True))
    return {"single_s": single_s, "batched_s": batched_s, "identical": same, "prompts": len(prompts), **counts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="run", default="runs/demo-real/own", help="a finished demo-real run")
    parser.add_argument("--assets-dir", default="runs/_assets")
    parser.add_argument("--prompts", type=int, default=48, help="training prompts decoded per batch size and round")
    parser.add_argument("--steps", type=int, default=8, help="training steps per dtype")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--heldout", type=int, default=48, help="held-out prompts decoded per evaluate arm")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from endpoint_sim.responder import Responder, SimConfig
    from endpoint_sim.smollm2 import DIR_NAME, ensure_smollm2_dir
    from flows.real_demo import REAL_BATCH
    from tasks.train.cpu_shim import cpu_native_bf16, cpu_train_dtype

    run_dir = Path(args.run).resolve()
    if not (run_dir / "hidden_states").is_dir():
        print(f"{run_dir} has no hidden_states: run `make demo-real` first or pass --from RUN_DIR", file=sys.stderr)
        return 2
    model_dir = ensure_smollm2_dir(Path(args.assets_dir).resolve() / DIR_NAME)
    render = Responder(model_dir, SimConfig(providers=("bench",)))
    train_file = REPO / "flows" / "data" / "real_prompts.jsonl"
    rounds: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        rounds.setdefault(name, []).append(round(value, 2))

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    messages = prompt_messages(train_file, args.prompts * args.rounds * 2)
    prompts = [render.prompt_ids_for_messages(m) for m in messages]
    for r in range(args.rounds):
        for i, batch in enumerate((16, REAL_BATCH)):  # fresh prompts each time: the responder caches answers
            chunk = prompts[(2 * r + i) * args.prompts : (2 * r + i + 1) * args.prompts]
            record(f"generate_tok_s_batch{batch}", generate_tok_s(model_dir, model, chunk, batch, threads=2))
    del model

    for _ in range(args.rounds):
        for dtype in ("bfloat16", "float32"):
            record(f"train_step_ms_{dtype}", train_step_ms(run_dir, dtype, args.steps))

    decodes = heldout_decode_s(run_dir, model_dir, args.heldout)
    record("evaluate_decode_s_single", decodes["single_s"])
    record("evaluate_decode_s_batched", decodes["batched_s"])

    mean = {name: statistics.mean(values) for name, values in rounds.items()}
    result = {
        "rounds": rounds,
        f"generate_batch{REAL_BATCH}_over_batch16": round(
            mean[f"generate_tok_s_batch{REAL_BATCH}"] / mean["generate_tok_s_batch16"], 2
        ),
        "train_bf16_over_float32_time": round(mean["train_step_ms_bfloat16"] / mean["train_step_ms_float32"], 2),
        "evaluate_single_over_batched_time": round(decodes["single_s"] / decodes["batched_s"], 2),
        "evaluate_decodes": {k: decodes[k] for k in ("prompts", "identical", "batched", "redecoded")},
        "cpu_native_bf16": cpu_native_bf16(),
        "cpu_train_dtype": cpu_train_dtype(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

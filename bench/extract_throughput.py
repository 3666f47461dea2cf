"""Extraction throughput against its physical limit, measured side by side in one run.

The stage (`tasks.extract.stage.extract_part`: tokens part in, checked safetensors shards + index out) can go
no faster than the slower of its two resources, each measured here on the same machine, model and data:

- raw forward: the same model (hooks paused) over the same planned batches, nothing copied or written;
- raw write: the same number of bytes the stage writes, written sequentially to the same directory in 64 MiB
  chunks from one buffer, then fsynced (the stage fsyncs every shard too).

Each runs `--rounds` times, interleaved (write, writer-only, forward, stage, write, ...), and the fastest run
of each counts: on a shared machine the best of interleaved runs is the closest to what each achieves alone.
`writer_only_vs_raw_write` isolates the write path (the stage's writer fed random states with the same batch
plan) against the raw write: where the disk is the limit, this is what bounds the ratio.
`ratio` = stage tok/s / min(raw forward tok/s, raw write tok/s): 1.0 means compute and I/O fully overlapped
with no extra copies. Also reported: bytes per token and the padding waste of the batch plan. The model is a
random-weight Llama built from a config (no download); sample lengths are log-normal, like chat data.

    python bench/extract_throughput.py                      # CPU, small model (~2-3 min on 2 cores)
    python bench/extract_throughput.py --device cuda --preset 1b --tokens 600000   # see bench/gpu_extract.sh

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tasks.common.config import DatasetConfig, EndpointConfig, ExtractConfig, PipelineConfig, TokenizerConfig  # noqa: E402
from tasks.common.schemas import TOKENS  # noqa: E402
from tasks.common.shards import PartRef, write_part  # noqa: E402
from tasks.extract.hf_backend import HFHiddenStateRunner  # noqa: E402
from tasks.extract.stage import extract_part  # noqa: E402
from tasks.extract.storage import DATA_DIR, DTYPES, HIDDEN_DIR, ShardSpec, plan_shards  # noqa: E402
from tasks.extract.writer import HostBatch, ShardStreamWriter  # noqa: E402

PRESETS: dict[str, dict[str, int]] = {
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
}
VOCAB = 32000
WRITE_CHUNK = 64 * 1024**2
SETTLE_S = 1.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(preset: str, device: torch.device, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=16384, **PRESETS[preset])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.to(dtype)  # type: ignore[arg-type]
    return model.eval()


def sample_lengths(target_tokens: int, median: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < target_tokens:
        lengths.append(max(16, min(max_len, int(rng.lognormvariate(math.log(median), 0.8)))))
    return lengths


def write_tokens(run_dir: Path, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed + 1)
    seqs = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]
    n = len(seqs)
    table = pa.table(
        {
            "sample_id": [f"b{i:06d}" for i in range(n)],
            "dataset": ["bench"] * n,
            "input_ids": seqs,
            "loss_mask": [[1] * len(s) for s in seqs],
            "prompt_len": [0] * n,
            "completion_len": [len(s) for s in seqs],
            "reasoning_len": [0] * n,
            "completion_format": ["bench"] * n,
        },
        schema=TOKENS,
    )
    write_part(PartRef(run_dir, "tokens", 0), table, {"bench": True})
    return seqs


def raw_forward_s(runner: HFHiddenStateRunner, seqs: list[list[int]], batches: list[list[int]]) -> float:
    """The same batches through the same decoder, hooks paused: the compute limit."""
    device = runner.input_device
    sync(device)
    started = time.perf_counter()
    with runner.hooks_paused(), torch.inference_mode():
        for batch in batches:
            ids, mask = runner.pad_batch([seqs[i] for i in batch])
            runner.decoder(input_ids=ids, attention_mask=mask, use_cache=False)
    sync(device)
    return time.perf_counter() - started


def planned_shards(
    cfg: PipelineConfig, runner: HFHiddenStateRunner, lengths: list[int], batches: list[list[int]]
) -> list[ShardSpec]:
    """The shards the stage will write (same planner), so the disk can be measured before the stage runs."""
    order = [i for b in batches for i in b]
    return plan_shards(0, order, lengths, runner.layout, cfg.extract.max_shard_bytes).shards


def settle() -> None:
    """Let torch's OpenMP threads stop spin-waiting after a CPU forward pass: spinning threads hold both cores
    of a small machine and would make a disk measurement taken right after one look several times slower."""
    time.sleep(SETTLE_S)


def raw_write_s(directory: Path, n_bytes: int) -> float:
    """n_bytes written sequentially to one file in `directory`, then fsynced: the disk limit."""
    settle()
    directory.mkdir(parents=True, exist_ok=True)
    buffer = os.urandom(min(WRITE_CHUNK, max(n_bytes, 1)))
    view = memoryview(buffer)
    path = directory / "raw-write-probe.bin"
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = n_bytes
        while left > 0:
            left -= os.write(fd, view[: min(left, len(view))])
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def writer_only_s(
    run_dir: Path,
    runner: HFHiddenStateRunner,
    seqs: list[list[int]],
    batches: list[list[int]],
    max_shard_bytes: int,
) -> float:
    """The stage's write path alone (checks, pwrite to planned offsets, fsync + rename) fed host batches of
    random states with the stage's batch plan: separates the writer's efficiency from the model's."""
    layout = runner.layout
    lengths = [len(s) for s in seqs]
    plan = plan_shards(0, [i for b in batches for i in b], lengths, layout, max_shard_bytes)
    rows = max(sum(lengths[i] for i in b) for b in batches)
    aux = torch.randn(rows, layout.aux_width).to(layout.dtype)
    final = torch.randn(rows, layout.hidden_size).to(layout.dtype)
    clean = torch.zeros(rows, dtype=torch.bool)
    shutil.rmtree(run_dir / HIDDEN_DIR, ignore_errors=True)
    settle()
    started = time.perf_counter()
    writer = ShardStreamWriter(run_dir, plan, layout, [str(i) for i in range(len(seqs))], seqs)
    for batch in batches:
        n = sum(lengths[i] for i in batch)
        writer.submit(HostBatch(batch, [lengths[i] for i in batch], aux[:n], final[:n], clean[:n], clean[:n]))
    writer.close()
    elapsed = time.perf_counter() - started
    shutil.rmtree(run_dir / HIDDEN_DIR, ignore_errors=True)
    return elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="eagle3-extract-bench-"))
    run_dir = work / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    started = time.perf_counter()
    model = build_model(args.preset, device, dtype, args.seed)
    model_s = time.perf_counter() - started
    runner = HFHiddenStateRunner(model, model_path=work, max_tokens_per_batch=args.max_tokens_per_batch)
    lengths = sample_lengths(args.tokens, args.median_len, args.max_len, args.seed)
    seqs = write_tokens(run_dir, lengths, args.seed)
    n_tokens = sum(lengths)
    batches = runner.plan_batches(lengths)
    cfg = PipelineConfig(
        run_dir=run_dir,
        datasets=[DatasetConfig(name="bench", path=run_dir / "unused.jsonl")],
        endpoint=EndpointConfig(model="bench"),
        tokenizer=TokenizerConfig(path=work),
        extract=ExtractConfig(
            dtype=args.dtype,
            device=args.device,
            max_tokens_per_batch=args.max_tokens_per_batch,
            max_shard_bytes=args.max_shard_bytes,
        ),
    )

    data_dir = run_dir / HIDDEN_DIR / DATA_DIR
    expected_bytes = sum(spec.size for spec in planned_shards(cfg, runner, lengths, batches))
    raw_forward_s(runner, seqs, batches[: args.warmup_batches])
    write_runs: list[float] = []
    forward_runs: list[float] = []
    stage_runs: list[float] = []
    writer_runs: list[float] = []
    stats: dict[str, Any] = {}
    for _ in range(args.rounds):
        write_runs.append(raw_write_s(data_dir, expected_bytes))
        writer_runs.append(writer_only_s(run_dir, runner, seqs, batches, args.max_shard_bytes))
        forward_runs.append(raw_forward_s(runner, seqs, batches))
        shutil.rmtree(run_dir / HIDDEN_DIR, ignore_errors=True)
        sync(device)
        stage_started = time.perf_counter()
        stats = extract_part(cfg, 0, runner)
        stage_runs.append(time.perf_counter() - stage_started)
        if stats["bytes"] != expected_bytes:
            raise RuntimeError(f"stage wrote {stats['bytes']} bytes, the plan said {expected_bytes}")
    stage_s = min(stage_runs)
    write_s = min(write_runs)
    forward_tok_s = n_tokens / min(forward_runs)
    write_tok_s = n_tokens / write_s
    stage_tok_s = n_tokens / stage_s
    limit = min(forward_tok_s, write_tok_s)
    params = sum(p.numel() for p in model.parameters())
    result = {
        "bench": "extract_throughput",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}",
        "preset": args.preset,
        "params": params,
        "layers": runner.num_layers,
        "hidden_size": runner.hidden_size,
        "dtype": args.dtype,
        "samples": len(lengths),
        "tokens": n_tokens,
        "batches": stats["batches"],
        "max_tokens_per_batch": args.max_tokens_per_batch,
        "padding_waste_frac": round(stats["padding_waste_frac"], 4),
        "bytes": stats["bytes"],
        "bytes_per_token": round(stats["bytes"] / n_tokens, 1),
        "shards": stats["shards"],
        "stage_tok_s": round(stage_tok_s, 1),
        "raw_forward_tok_s": round(forward_tok_s, 1),
        "raw_forward_runs_s": [round(t, 3) for t in forward_runs],
        "raw_write_tok_s": round(write_tok_s, 1),
        "raw_write_runs_s": [round(t, 3) for t in write_runs],
        "raw_write_gb_s": round(stats["bytes"] / write_s / 1e9, 3),
        "writer_only_tok_s": round(n_tokens / min(writer_runs), 1),
        "writer_only_vs_raw_write": round(write_s / min(writer_runs), 4),
        "limit": "forward" if forward_tok_s <= write_tok_s else "write",
        "ratio": round(stage_tok_s / limit, 4),
        "stage_runs_s": [round(t, 3) for t in stage_runs],
        "writer_busy_s": stats["writer_busy_s"],
        "writer_ready_wait_s": stats["writer_ready_wait_s"],
        "submit_wait_s": stats["submit_wait_s"],
        "model_build_s": round(model_s, 2),
        "torch": torch.__version__,
    }
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tokens", type=int, default=60_000, help="total tokens of the generated part")
    parser.add_argument("--median-len", type=int, default=600)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--max-tokens-per-batch", type=int, default=4096)
    parser.add_argument("--max-shard-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--warmup-batches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="raw write, raw forward, stage; best of each counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="directory for the run (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args()
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()

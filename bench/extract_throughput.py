"""Extraction throughput against its physical limit, measured side by side in one run.

The stage (`tasks.extract.stage.extract_part`: tokens part in, checked safetensors shards + index out) can go
no faster than the slower of its two resources, each measured here on the same machine, model and data:

- raw forward: the same model (hooks paused) over the same planned batches, nothing copied or written;
- raw write: the same number of bytes the stage writes, written sequentially to the same directory in 64 MiB
  chunks from one buffer, then fsynced (the stage fsyncs every shard too).

The stage runs twice per round, with the target's scoring of the answer tokens (`scoring.enabled`, the default:
the final norm's output through the lm_head, chunked, for every answer token) and without. Scoring adds compute
the raw forward does not do, so a third reference is measured: the raw forward plus the same lm_head over the
same answer rows, in plain torch (`raw_scored_forward`). Its cost relative to the forward is the head's share,
which depends on the model: for Kimi-K2.5 the lm_head is about 2-4% of a token's forward pass, for the small
CPU preset here it is about 65% (H = 512, 32,000 entries, 8 layers). Answers are the last 2/3 of each sample.

Each runs `--rounds` times, interleaved (write, writer-only, forward, stage, write, ...), and the fastest run
of each counts: on a shared machine the best of interleaved runs is the closest to what each achieves alone.
`writer_only_vs_raw_write` isolates the write path (the stage's writer fed random states with the same batch
plan) against the raw write: where the disk is the limit, this is what bounds the ratio.
`ratio` = stage tok/s (scoring off) / min(raw forward tok/s, raw write tok/s): 1.0 means compute and I/O fully
overlapped with no extra copies. `ratio_scoring` is the same with scoring on, `ratio_scoring_vs_scored_forward`
against min(raw scored forward, raw write). Also reported: bytes per token and the padding waste of the batch
plan. The model is a random-weight Llama built from a config (no download); sample lengths are log-normal, like
chat data.

    python bench/extract_throughput.py                      # CPU, small model (~4-5 min on 2 cores)
    python bench/extract_throughput.py --device cuda --preset 1b --tokens 600000   # see bench/gpu_extract.sh

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
    "tiny": {  # --tiny: seconds on a CPU, to check the whole script end to end
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    "1b": {  # TinyLlama-1.1B's shape
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
    },
    "8b": {  # Llama-3-8B's shape (8.0B parameters)
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
}
WRITE_CHUNK = 64 * 1024**2
SETTLE_S = 1.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(preset: str, device: torch.device, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(max_position_embeddings=16384, **PRESETS[preset])
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def sample_lengths(target_tokens: int, median: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < target_tokens:
        lengths.append(max(16, min(max_len, int(rng.lognormvariate(math.log(median), 0.8)))))
    return lengths


def write_tokens(run_dir: Path, lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed + 1)
    seqs = [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]
    write_tokens_from(run_dir, seqs)
    return seqs


def write_tokens_from(run_dir: Path, seqs: list[list[int]]) -> None:
    n = len(seqs)
    table = pa.table(
        {
            "sample_id": [f"b{i:06d}" for i in range(n)],
            "dataset": ["bench"] * n,
            "input_ids": seqs,
            "loss_mask": [[1] * len(s) for s in seqs],
            "prompt_len": [len(s) // 3 for s in seqs],
            "completion_len": [len(s) - len(s) // 3 for s in seqs],
            "reasoning_len": [0] * n,
            "completion_format": ["bench"] * n,
            "token_source": ["reencoded"] * n,
        },
        schema=TOKENS,
    )
    write_part(PartRef(run_dir, "tokens", 0), table, {"bench": True})


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


def raw_scored_forward_s(
    runner: HFHiddenStateRunner, seqs: list[list[int]], batches: list[list[int]], chunk_tokens: int
) -> float:
    """The raw forward plus what scoring must compute at least: the lm_head over every answer token's predecessor
    row, log-softmax and top-1 in float32, in chunks of `chunk_tokens` rows; plain torch, nothing kept."""
    device = runner.input_device
    lm_head = runner.score_head.lm_head
    sync(device)
    started = time.perf_counter()
    with runner.hooks_paused(), torch.inference_mode():
        for batch in batches:
            rows = [seqs[i] for i in batch]
            ids, mask = runner.pad_batch(rows)
            normed = runner.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            width = normed.shape[1]
            index = torch.cat([torch.arange(n * width + len(r) // 3, n * width + len(r)) for n, r in enumerate(rows)])
            targets = torch.cat([torch.tensor(r[len(r) // 3 :]) for r in rows]).to(device)
            source = normed.reshape(-1, normed.shape[-1])
            index = (index - 1).to(device)  # answer token p is predicted from row p - 1
            for start in range(0, len(index), chunk_tokens):
                logits = lm_head(source.index_select(0, index[start : start + chunk_tokens])).float()
                wanted = logits.gather(1, targets[start : start + chunk_tokens, None])[:, 0]
                peak = logits.amax(dim=1)
                (wanted >= peak).sum()
                (wanted - peak - logits.sub_(peak[:, None]).exp_().sum(dim=1).log()).sum()
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


def _write_file(path: Path, n_bytes: int, view: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = n_bytes
        while left > 0:
            left -= os.write(fd, view[: min(left, len(view))])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_s(directory: Path, n_bytes: int, streams: int = 1) -> float:
    """n_bytes written sequentially to `streams` files in `directory` from as many threads (each file
    n_bytes / streams, each fsynced): the disk limit. One stream understates disks that need queue depth (NVMe
    RAID, network volumes), which is why the stage, with its fsync thread, once beat the one-stream figure."""
    settle()
    directory.mkdir(parents=True, exist_ok=True)
    view = memoryview(os.urandom(min(WRITE_CHUNK, max(n_bytes, 1))))
    paths = [directory / f"raw-write-probe-{i}.bin" for i in range(streams)]
    sizes = [n_bytes // streams + (1 if i < n_bytes % streams else 0) for i in range(streams)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        list(pool.map(_write_file, paths, sizes, [view] * streams))
    elapsed = time.perf_counter() - started
    for path in paths:
        path.unlink()
    return elapsed


class GpuSampler:
    """`nvidia-smi` sampled every `interval_ms` in the background; each sample is stamped on arrival, so the
    phases of the run (raw forward, stage, ...) can be matched to the utilisation they produced. A no-op
    without nvidia-smi (CPU runs)."""

    def __init__(self, interval_ms: int = 100) -> None:
        self.samples: list[tuple[float, float, float, float]] = []  # (t, util %, mem util %, memory MiB)
        self.phases: list[tuple[str, float, float]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self.t0 = time.perf_counter()
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return
        query = "--query-gpu=utilization.gpu,utilization.memory,memory.used"
        cmd = [exe, query, "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}", "-i", "0"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                util, mem_util, mem = (float(p) for p in parts[:3])
            except ValueError:
                continue
            self.samples.append((time.perf_counter() - self.t0, util, mem_util, mem))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter() - self.t0
        try:
            yield
        finally:
            self.phases.append((name, started, time.perf_counter() - self.t0))

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def summary(self) -> dict[str, Any] | None:
        """Mean and 10th-percentile GPU utilisation per phase kind (best of its runs), samples per phase."""
        if self._proc is None:
            return None
        out: dict[str, Any] = {}
        for name, start, end in self.phases:
            utils = sorted(u for t, u, _, _ in self.samples if start <= t <= end)
            if not utils:
                continue
            entry = {
                "mean_util_pct": round(sum(utils) / len(utils), 1),
                "p10_util_pct": utils[len(utils) // 10],
                "samples": len(utils),
            }
            kind = name.rsplit("#", 1)[0]
            if kind not in out or entry["mean_util_pct"] > out[kind]["mean_util_pct"]:
                out[kind] = entry
        return out

    def write_csv(self, path: Path) -> None:
        with path.open("w") as f:
            f.write("t_s,util_gpu_pct,util_mem_pct,memory_mib,phase\n")
            for t, util, mem_util, mem in self.samples:
                phase = next((n for n, a, b in self.phases if a <= t <= b), "")
                f.write(f"{t:.3f},{util},{mem_util},{mem},{phase}\n")


def profile_stage(
    cfg: PipelineConfig, runner: HFHiddenStateRunner, seqs: list[list[int]], batches: list[list[int]], out: Path
) -> dict[str, Any]:
    """The stage over its first few batches (a part of their samples) under torch.profiler, with CUDA's sync
    debug mode on: a Chrome trace, the top operators, and every synchronizing call site the main thread hit."""
    device = runner.input_device
    samples = [i for batch in batches for i in batch]
    run_dir = cfg.run_dir.parent / "profile-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    write_tokens_from(run_dir, [seqs[i] for i in samples])
    pcfg = cfg.model_copy(update={"run_dir": run_dir})
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught, torch.profiler.profile(activities=activities) as prof:
        warnings.simplefilter("always")
        extract_part(pcfg, 0, runner)
        sync(device)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    trace = out / f"trace-{cfg.extract.dtype}-{len(samples)}samples.json"
    prof.export_chrome_trace(str(trace))
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=25)
    (out / "profile_top_ops.txt").write_text(table)
    sync_sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            site = f"{Path(w.filename).name}:{w.lineno}"
            sync_sites[site] = sync_sites.get(site, 0) + 1
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "profiled_batches": len(batches),
        "trace": str(trace),
        "sync_calls": sum(sync_sites.values()),
        "sync_sites": sync_sites,
    }


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
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="eagle3-extract-bench-"))
    run_dir = work / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    sampler = GpuSampler() if device.type == "cuda" else None
    started = time.perf_counter()
    model = build_model(args.preset, device, dtype, args.seed)
    model_s = time.perf_counter() - started
    runner = HFHiddenStateRunner(model, model_path=work, max_tokens_per_batch=args.max_tokens_per_batch)
    lengths = sample_lengths(args.tokens, args.median_len, args.max_len, args.seed)
    seqs = write_tokens(run_dir, lengths, args.seed, int(PRESETS[args.preset]["vocab_size"]))
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
    unscored = cfg.model_copy(update={"scoring": cfg.scoring.model_copy(update={"enabled": False})})
    chunk_tokens = cfg.scoring.logits_chunk_tokens
    scored_tokens = sum(n - n // 3 for n in lengths)

    def phase(name: str) -> contextlib.AbstractContextManager[None]:
        return sampler.phase(name) if sampler is not None else contextlib.nullcontext()

    data_dir = run_dir / HIDDEN_DIR / DATA_DIR
    expected_bytes = sum(spec.size for spec in planned_shards(cfg, runner, lengths, batches))
    raw_forward_s(runner, seqs, batches[: args.warmup_batches])
    write_runs: list[float] = []
    multi_write_runs: list[float] = []
    forward_runs: list[float] = []
    scored_forward_runs: list[float] = []
    stage_runs: list[float] = []
    unscored_runs: list[float] = []
    writer_runs: list[float] = []
    stats: dict[str, Any] = {}
    for r in range(args.rounds):
        with phase(f"raw_write_1_stream#{r}"):
            write_runs.append(raw_write_s(data_dir, expected_bytes))
        if args.write_streams > 1:
            with phase(f"raw_write_{args.write_streams}_streams#{r}"):
                multi_write_runs.append(raw_write_s(data_dir, expected_bytes, args.write_streams))
        with phase(f"writer_only#{r}"):
            writer_runs.append(writer_only_s(run_dir, runner, seqs, batches, args.max_shard_bytes))
        with phase(f"raw_forward#{r}"):
            forward_runs.append(raw_forward_s(runner, seqs, batches))
        with phase(f"raw_scored_forward#{r}"):
            scored_forward_runs.append(raw_scored_forward_s(runner, seqs, batches, chunk_tokens))
        for config, runs, name in ((unscored, unscored_runs, "stage_no_scoring"), (cfg, stage_runs, "stage")):
            shutil.rmtree(run_dir / HIDDEN_DIR, ignore_errors=True)
            sync(device)
            with phase(f"{name}#{r}"):
                stage_started = time.perf_counter()
                stats = extract_part(config, 0, runner)
                runs.append(time.perf_counter() - stage_started)
            if stats["bytes"] != expected_bytes:
                raise RuntimeError(f"stage wrote {stats['bytes']} bytes, the plan said {expected_bytes}")
        if stats["scores"]["scored_tokens"] != scored_tokens:
            raise RuntimeError(f"stage scored {stats['scores']['scored_tokens']} tokens, expected {scored_tokens}")
    profile = None
    if out is not None and args.profile_batches > 0:
        with phase("profiled_stage#0"):
            profile = profile_stage(cfg, runner, seqs, batches[: args.profile_batches], out)
    if sampler is not None:
        sampler.stop()
    stage_s = min(unscored_runs)
    write_s = min(write_runs + multi_write_runs)
    forward_tok_s = n_tokens / min(forward_runs)
    scored_forward_tok_s = n_tokens / min(scored_forward_runs)
    write_tok_s = n_tokens / write_s
    stage_tok_s = n_tokens / stage_s
    scoring_tok_s = n_tokens / min(stage_runs)
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
        "raw_write_gb_s": round(stats["bytes"] / write_s / 1e9, 3),
        "raw_write_1_stream_runs_s": [round(t, 3) for t in write_runs],
        f"raw_write_{args.write_streams}_streams_runs_s": [round(t, 3) for t in multi_write_runs],
        "writer_only_tok_s": round(n_tokens / min(writer_runs), 1),
        "writer_only_vs_raw_write": round(write_s / min(writer_runs), 4),
        "limit": "forward" if forward_tok_s <= write_tok_s else "write",
        "ratio": round(stage_tok_s / limit, 4),
        "scored_token_frac": round(scored_tokens / n_tokens, 4),
        "stage_scoring_tok_s": round(scoring_tok_s, 1),
        "raw_scored_forward_tok_s": round(scored_forward_tok_s, 1),
        "head_share_of_forward": round(min(scored_forward_runs) / min(forward_runs) - 1, 4),
        "ratio_scoring": round(scoring_tok_s / limit, 4),
        "ratio_scoring_vs_scored_forward": round(scoring_tok_s / min(scored_forward_tok_s, write_tok_s), 4),
        "scoring_vs_no_scoring": round(scoring_tok_s / stage_tok_s, 4),
        "stage_scoring_runs_s": [round(t, 3) for t in stage_runs],
        "raw_scored_forward_runs_s": [round(t, 3) for t in scored_forward_runs],
        "stage_vs_raw_forward": round(stage_tok_s / forward_tok_s, 4),
        "stage_vs_raw_write": round(stage_tok_s / write_tok_s, 4),
        "stage_runs_s": [round(t, 3) for t in unscored_runs],
        "writer_busy_s": stats["writer_busy_s"],
        "writer_ready_wait_s": stats["writer_ready_wait_s"],
        "submit_wait_s": stats["submit_wait_s"],
        "gpu_util": sampler.summary() if sampler is not None else None,
        "profile": profile,
        "model_build_s": round(model_s, 2),
        "torch": torch.__version__,
    }
    if sampler is not None and out is not None:
        sampler.write_csv(out / "gpu_util.csv")
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
    parser.add_argument("--write-streams", type=int, default=4, help="also measure the raw write with N files")
    parser.add_argument("--profile-batches", type=int, default=0, help="profile the stage over N batches (--out)")
    parser.add_argument("--out", default=None, help="directory for the GPU utilisation CSV and profiler output")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="directory for the run (default: a new temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument(
        "--tiny", action="store_true", help="an 8-layer H=64 model over 4,000 tokens, 1 round: checks the script"
    )
    args = parser.parse_args()
    if args.tiny:
        args.preset, args.tokens, args.rounds, args.median_len = "tiny", 4000, 1, 200
        args.max_len, args.max_tokens_per_batch, args.warmup_batches = 1024, 1024, 1
        args.profile_batches = args.profile_batches or 2
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()

"""Reconstruct stage throughput (Parquet in, Parquet out) vs raw `tokenizers` `encode_batch` on the same texts.

Both sides run in this process, on the same machine and cores, one after the other, `--repeats` times; the best
wall time of each is kept. The stage side is `tasks.reconstruct.stage.reconstruct_part` over real prompts/responses
parts (chat-template rendering, completion layout, batch encoding with offsets, spans, masks, Parquet write);
the raw side is `Tokenizer.encode_batch` over the stage's own rendered prompt strings and completion strings.
Two informative numbers ride along: `encode_batch_fast` (no offsets) over the same texts, and the naive
approach (per sample `apply_chat_template(tokenize=True)` + `encode`).

Synthetic but realistic samples: completions of 2-8k tokens (reasoning + content) built from the tokenizer's
own word pieces, sentences, numbers, code lines and some CJK text, with short prompts.

The validate stage (`tasks.validate.checks.validate_part`: reference, structure and special-token checks on the
ids, prompt-token reconciliation, tool-call markup, whitespace) is timed over the same parts and printed beside
them as `validate_tok_s` and `validate_ratio` (vs raw `encode_batch`), informative: it runs after reconstruction.

Prints one JSON line: {"ratio": stage tok/s / raw tok/s, ...}. Goal: ratio >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from endpoint_sim.assets import write_tokenizer_dir
from tasks.common.config import DatasetConfig, EndpointConfig, PipelineConfig, TokenizerConfig
from tasks.common.messages import Message, prompt_messages, sample_id
from tasks.common.schemas import PROMPTS, RESPONSES
from tasks.common.shards import PartRef, done_parts, read_part, write_part
from tasks.reconstruct.completion_format import PRESETS, completion_layout
from tasks.reconstruct.stage import reconstruct_part
from tasks.reconstruct.tokenizer_backend import backend_for
from tasks.reconstruct.tokenizer_loading import load_tokenizer, render_prompt
from tasks.validate.checks import validate_part

FORMAT = PRESETS["deepseek_v4_thinking"]
DATASET = "bench"
CODE = ["def f(x):", "    return x * 2 + 1", "for i in range(10):", "    total += values[i]", "}", "if (n > 0) {"]
CJK = ["这是一个测试句子。", "模型需要逐步推理。", "日本語の文章も含まれます。"]


def words_from(tokenizer: Any, rng: random.Random) -> list[str]:
    vocab = [tokenizer.decode([i]) for i in rng.sample(range(1000, 100000), 6000)]
    return [w for w in vocab if w.strip().isalpha() and w.isascii() and 2 < len(w.strip()) < 12]


def paragraph(rng: random.Random, words: list[str], n_words: int) -> str:
    out: list[str] = []
    for i in range(n_words):
        w = rng.choice(words).strip()
        if i % 11 == 0:
            w = w.capitalize()
        out.append(w)
        r = rng.random()
        if r < 0.06:
            out[-1] += "."
        elif r < 0.1:
            out[-1] += ","
        elif r < 0.12:
            out.append(str(rng.randint(0, 99999)))
        elif r < 0.13:
            out.append("\n" + "\n".join(rng.sample(CODE, 3)) + "\n")
        elif r < 0.14:
            out.append(rng.choice(CJK))
        elif r < 0.16:
            out[-1] += ".\n\n"
    return " ".join(out)


def build_parts(run_dir: Path, tokenizer: Any, samples: int, parts: int, seed: int) -> None:
    rng = random.Random(seed)
    words = words_from(tokenizer, rng)
    per_part = -(-samples // parts)
    for part in range(parts):
        prompts, responses = [], []
        for i in range(per_part):
            messages = [Message(role="user", content=f"Question {part}-{i}: " + paragraph(rng, words, 60))]
            sid = sample_id(DATASET, prompt_messages(messages))
            total_words = rng.randint(1200, 4800)  # ~2-8k tokens
            reasoning_words = int(total_words * rng.uniform(0.3, 0.7))
            source = {"source_file": "synthetic", "source_row": i}
            prompts.append(
                {
                    "sample_id": sid,
                    "dataset": DATASET,
                    **source,
                    "messages": messages,
                    "prompt_id": sid,
                    "sample_index": 0,
                }
            )
            row: dict[str, Any] = {name: None for name in RESPONSES.names}
            row.update(
                sample_id=sid,
                dataset=DATASET,
                status="done",
                reasoning=paragraph(rng, words, reasoning_words),
                content=paragraph(rng, words, total_words - reasoning_words),
                finish_reason="stop",
                attempts=1,
            )
            responses.append(row)
        ref = PartRef(run_dir, "prompts", part)
        write_part(ref, pa.Table.from_pylist(prompts, schema=PROMPTS), {})
        write_part(ref.with_stage("responses"), pa.Table.from_pylist(responses, schema=RESPONSES), {})


def stage_texts(cfg: PipelineConfig, tokenizer: Any) -> list[str]:
    """The exact strings the stage encodes: rendered prompts and laid-out completions."""
    texts: list[str] = []
    for ref in done_parts(cfg.run_dir, "prompts"):
        prompts = read_part(ref).to_pylist()
        responses = read_part(ref.with_stage("responses")).to_pylist()
        texts += [render_prompt(tokenizer, prompt_messages(p["messages"])) for p in prompts]
        texts += [completion_layout(FORMAT, r["reasoning"], r["content"]).text for r in responses]
    return texts


def time_stage(cfg: PipelineConfig) -> tuple[float, int]:
    shutil.rmtree(cfg.run_dir / "tokens", ignore_errors=True)
    parts = [r.part for r in done_parts(cfg.run_dir, "responses")]
    start = time.perf_counter()
    stats = [reconstruct_part(cfg, p, FORMAT) for p in parts]
    wall = time.perf_counter() - start
    return wall, sum(s["tokens"] for s in stats)


def time_validate(cfg: PipelineConfig) -> tuple[float, int]:
    """Validate every tokens part (they exist after `time_stage`)."""
    shutil.rmtree(cfg.run_dir / "validation", ignore_errors=True)
    parts = [r.part for r in done_parts(cfg.run_dir, "tokens")]
    start = time.perf_counter()
    for p in parts:
        validate_part(cfg, p, FORMAT)
    wall = time.perf_counter() - start
    tokens = sum(
        read_part(r, columns=["input_ids"]).column("input_ids").combine_chunks().values.__len__()
        for r in done_parts(cfg.run_dir, "tokens")
    )
    return wall, tokens


def time_raw(backend: Any, texts: list[str], fast: bool = False) -> tuple[float, int]:
    encode = backend.encode_batch_fast if fast else backend.encode_batch
    start = time.perf_counter()
    encodings = encode(texts, add_special_tokens=False)
    wall = time.perf_counter() - start
    return wall, sum(len(e.ids) for e in encodings)


def time_naive(tokenizer: Any, cfg: PipelineConfig) -> tuple[float, int]:
    tokens = 0
    start = time.perf_counter()
    for ref in done_parts(cfg.run_dir, "prompts"):
        prompts = read_part(ref).to_pylist()
        responses = read_part(ref.with_stage("responses")).to_pylist()
        for p, r in zip(prompts, responses, strict=True):
            ids = tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in p["messages"]],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
            text = completion_layout(FORMAT, r["reasoning"], r["content"]).text
            tokens += len(ids) + len(tokenizer.encode(text, add_special_tokens=False))
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-naive", action="store_true", help="skip the per-sample baseline")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="eagle3-bench-"))
    try:
        tok_dir = write_tokenizer_dir(root / "tokenizer")
        cfg = PipelineConfig(
            run_dir=root / "run",
            datasets=[DatasetConfig(name=DATASET, path=root / "unused.jsonl")],
            endpoint=EndpointConfig(model="bench"),
            tokenizer=TokenizerConfig(path=tok_dir, completion_format=FORMAT.name),
        )
        tokenizer = load_tokenizer(cfg.tokenizer)
        backend = backend_for(tokenizer)
        build_parts(cfg.run_dir, tokenizer, args.samples, args.parts, args.seed)
        texts = stage_texts(cfg, tokenizer)
        raw_backend = tokenizer.backend_tokenizer
        time_raw(raw_backend, texts[:32])  # warm both paths (thread pools, caches)
        time_stage(cfg)

        raw_walls, fast_walls, stage_walls, validate_walls = [], [], [], []
        raw_tokens = stage_tokens = 0
        for _ in range(args.repeats):
            wall, raw_tokens = time_raw(raw_backend, texts)
            raw_walls.append(wall)
            fast_walls.append(time_raw(raw_backend, texts, fast=True)[0])
            wall, stage_tokens = time_stage(cfg)
            stage_walls.append(wall)
            wall, validated_tokens = time_validate(cfg)
            validate_walls.append(wall)
        if raw_tokens != stage_tokens:
            raise SystemExit(f"token counts differ: raw {raw_tokens} vs stage {stage_tokens}")
        result: dict[str, Any] = {
            "bench": "reconstruct_throughput",
            "samples": args.samples,
            "parts": args.parts,
            "tokens": stage_tokens,
            "mean_tokens_per_sample": round(stage_tokens / args.samples),
            "cpu_count": os.cpu_count(),
            "backend": backend.kind,
            "repeats": args.repeats,
            "raw_wall_s": round(min(raw_walls), 3),
            "stage_wall_s": round(min(stage_walls), 3),
            "raw_tok_s": round(raw_tokens / min(raw_walls)),
            "stage_tok_s": round(stage_tokens / min(stage_walls)),
            "raw_fast_tok_s": round(raw_tokens / min(fast_walls)),
            "validate_wall_s": round(min(validate_walls), 3),
            "validate_tok_s": round(validated_tokens / min(validate_walls)),
        }
        if not args.no_naive:
            wall, naive_tokens = time_naive(tokenizer, cfg)
            result["naive_tok_s"] = round(naive_tokens / wall)
            result["naive_ratio"] = round(result["naive_tok_s"] / result["raw_tok_s"], 3)
        result["ratio_vs_encode_batch_fast"] = round(result["stage_tok_s"] / result["raw_fast_tok_s"], 3)
        result["validate_ratio"] = round(result["validate_tok_s"] / result["raw_tok_s"], 3)
        result["ratio"] = round(result["stage_tok_s"] / result["raw_tok_s"], 3)
        print(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

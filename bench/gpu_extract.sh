#!/usr/bin/env bash
# One prepared GPU run (an H200 in our case) of the extraction checks and benchmarks, for both model shapes,
# in under 9 minutes; everything it measures lands in $OUT (default /tmp/eagle3-gpu-bench):
#   1. `python -m tasks.extract.gpu_check` on the real device (torch's arch list against its capability), and
#      the CUDA tests: tests/test_extract.py (side-stream copies to pinned memory store exactly what an
#      unbatched CUDA forward computes; device_map over two GPUs where there are two), tests/test_gpu_check.py
#      and tests/test_extract_device_map.py;
#   2. bench/extract_throughput.py for a ~1.1B random-weight Llama (TinyLlama's shape: 22 layers, H=2048) and an
#      8B-shaped one (Llama-3-8B's shape: 32 layers, H=4096), both built from a config (never downloaded), each
#      printing one JSON line: stage tok/s against the raw forward pass and against the raw sequential write of
#      the same bytes to the same disk (1 and 4 streams, the faster counts), the ratio to min(forward, write),
#      padding waste, the same stage with the target scoring every answer token (`ratio_scoring`, the raw forward
#      plus the lm_head over the answer rows: `raw_scored_forward_tok_s`), GPU utilisation per phase
#      (nvidia-smi every 100 ms; $OUT/<preset>/gpu_util.csv), and a
#      torch.profiler trace of the stage over 3 batches with CUDA's sync debug mode on
#      ($OUT/<preset>/trace-*.json, profile_top_ops.txt, sync call sites in the JSON);
#   3. a side-by-side table of both shapes ($OUT/summary.txt).
#
# Check the script end to end on a CPU first: `TINY=1 bench/gpu_extract.sh` (seconds; no GPU, no nvidia-smi).
#   Between 1 and 2, tests/test_train.py on the device: speculators' own trainer with what it uses on a GPU
#   (FlexAttention, the fused Triton loss, bf16 autocast; `TrainOptions.for_device`), which no CPU run exercises.
# Uses the machine's own torch. Packages it lacks (bench/gpu_wheels.txt: pydantic, the tokenizer, speculators and
# what it imports, and the transformers/huggingface_hub this project pins) travel as wheels in .whl/ (git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl -r bench/gpu_wheels.txt
# The tests run without Prefect (tests/conftest.py imports it only where installed; its tests skip).
# Knobs (environment): DEVICE (cuda), PRESETS ("1b 8b"), TOKENS_1b (600000), TOKENS_8b (200000), MAX_TOKENS
# (16384), ROUNDS (2), TINY, SKIP_WHEELS, SKIP_TESTS, SKIP_TRAIN, WORK (scratch directory on the disk to measure).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/eagle3-site .whl/*.whl
  export PYTHONPATH="/tmp/eagle3-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

OUT_DIR="${OUT:-/tmp/eagle3-gpu-bench}"
WORK="${WORK:-/tmp/eagle3-extract-bench}"
mkdir -p "$OUT_DIR"

python3 - <<'PY' | tee "$OUT_DIR/versions.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "arch list", torch.cuda.get_arch_list(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PY

if [ -n "${TINY:-}" ]; then
  DEVICE="${DEVICE:-cpu}"
  for preset in tiny; do
    mkdir -p "$OUT_DIR/$preset"
    timeout 300 python3 bench/extract_throughput.py --tiny --device "$DEVICE" --workdir "$WORK/$preset" \
      --out "$OUT_DIR/$preset" | tee "$OUT_DIR/$preset.json"
  done
  PRESETS=tiny
else
  DEVICE="${DEVICE:-cuda}"
  python3 -m tasks.extract.gpu_check 2>&1 | tee "$OUT_DIR/gpu_check.txt" || echo "GPU CHECK REFUSED THIS DEVICE"
  if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_extract.py tests/test_gpu_check.py \
      tests/test_extract_device_map.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" \
      || echo "GPU TESTS FAILED (exit $?); running the benchmarks anyway"
  fi
  if [ -z "${SKIP_TESTS:-}${SKIP_TRAIN:-}" ]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_train.py 2>&1 \
      | tee "$OUT_DIR/gpu_train_tests.log" || echo "TRAIN TESTS FAILED (exit $?); running the benchmarks anyway"
  fi
  PRESETS="${PRESETS:-1b 8b}"
  for preset in $PRESETS; do
    tokens_var="TOKENS_$preset"
    default_tokens=600000
    [ "$preset" = "8b" ] && default_tokens=200000
    mkdir -p "$OUT_DIR/$preset"
    timeout 240 python3 bench/extract_throughput.py --device "$DEVICE" --preset "$preset" \
      --tokens "${!tokens_var:-$default_tokens}" --max-tokens-per-batch "${MAX_TOKENS:-16384}" \
      --rounds "${ROUNDS:-2}" --profile-batches 3 --workdir "$WORK/$preset" --out "$OUT_DIR/$preset" \
      | tee "$OUT_DIR/$preset.json" || echo "BENCHMARK $preset FAILED (exit $?)"
    rm -rf "${WORK:?}/$preset"
  done
fi

OUT_DIR="$OUT_DIR" PRESETS="$PRESETS" python3 - <<'PY' | tee "$OUT_DIR/summary.txt"
import json, os
from pathlib import Path
out = Path(os.environ["OUT_DIR"])
cols = ["preset", "tokens", "pad_waste", "B/token", "fwd tok/s", "write tok/s", "write GB/s", "stage tok/s",
        "ratio", "stage/fwd", "limit", "util fwd", "util stage", "syncs", "ratio scoring", "scoring/no", "head share"]
print(" | ".join(cols))
for preset in os.environ["PRESETS"].split():
    path = out / f"{preset}.json"
    lines = [l for l in path.read_text().splitlines() if l.startswith("{")] if path.exists() else []
    if not lines:
        print(f"{preset} | no result")
        continue
    r = json.loads(lines[-1])
    util = r.get("gpu_util") or {}
    prof = r.get("profile") or {}
    print(" | ".join(str(v) for v in [
        preset, r["tokens"], f"{r['padding_waste_frac']:.1%}", r["bytes_per_token"], r["raw_forward_tok_s"],
        r["raw_write_tok_s"], r["raw_write_gb_s"], r["stage_tok_s"], r["ratio"], r["stage_vs_raw_forward"],
        r["limit"], util.get("raw_forward", {}).get("mean_util_pct", "-"),
        util.get("stage", {}).get("mean_util_pct", "-"), prof.get("sync_calls", "-"), r.get("ratio_scoring", "-"),
        r.get("scoring_vs_no_scoring", "-"), r.get("head_share_of_forward", "-"),
    ]))
PY

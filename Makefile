# Every target bootstraps what it needs, so a fresh clone runs `make demo` or `make test`
# and nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv demo test lint unit bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Until the live demo lands: size a sample fleet with the planner.
demo: venv
	$(BIN)/isocost plan --model llama-3.1-8b --gpu a100-80g --qps 20 --context 4096 --output-tokens 512 --ttft-slo-ms 1000 --tpot-slo-ms 50
	$(BIN)/isocost plan --model llama-3.1-70b --gpu h100-80g --concurrency 128 --context 8192 --output-tokens 512
	$(BIN)/isocost plan --model mixtral-8x7b --gpu l40s-48g --qps 5 --explain

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q tests

unit: venv
	$(BIN)/python -m pytest -q tests/unit tests/property

bench: venv
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

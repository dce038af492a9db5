# Every target bootstraps what it needs, so a fresh clone runs `make demo` or `make test`
# and nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CHROMIUM := /usr/bin/chromium

.PHONY: venv demo browser test lint unit bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Round-robin vs equal-cost on a local heterogeneous cluster (a few minutes on 2 cores).
demo: venv
	$(BIN)/isocost demo

# The dashboard's browser test drives Debian's chromium through Playwright, which never
# downloads a browser of its own; as root on a fresh machine, install it.
browser:
	@test -x $(CHROMIUM) || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else \
	    echo "warning: no $(CHROMIUM) and not root: the browser test will be skipped"; \
	  fi; }

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

test: lint browser
	$(BIN)/python -m pytest -q tests

unit: venv
	$(BIN)/python -m pytest -q tests/unit tests/property

bench: venv
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

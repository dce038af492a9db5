#!/usr/bin/env bash
# isocost vs sglang-router and vllm-router on the same trace and engines; see run.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "$root/.venv/bin/python" "$root/benchmarks/peers/run.py" "$@"

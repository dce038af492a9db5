#!/usr/bin/env bash
# Capacity at SLO of equal_cost against the peers' routing with the same SLO admission
# (<peer>_slo), by bisection, on the shared traces and several fleets. One run of this
# script gives every row of the README's "equal terms" table. 6,000 requests per regime:
# with 2,000, rates 1% apart gave attainments up to a point apart, either way (a sweep
# of equal_cost on 16 x A100 from 9.8 to 10.7 req/s), so one bisection step (3-5%) was
# within the noise; with 6,000 the same sweep moves by 0.4 points at most.
#   benchmarks/equal_terms/run.sh [OUT_DIR] [TRACES_DIR]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-equal-terms-results}"
traces="${2:-$root/../shared/traces}"
mkdir -p "$out"
isocost="$root/.venv/bin/isocost"
peers=equal_cost,llmd_default_slo,dynamo_kv_slo,sglang_cache_aware_slo,prefix_slo,least_request_slo
mooncake="$traces/mooncake_conversation_trace.jsonl"
long_slo=(--slo-ttft-ms 1000 --slo-ttft-per-1k-ms 250 --slo-tpot-ms 100)
run() {  # name, then sim arguments
  local name="$1"; shift
  echo "== $name" | tee "$out/$name.txt"
  "$isocost" sim --policies "$peers" --jobs 2 --json "$out/$name.json" "$@" \
    | tee -a "$out/$name.txt"
}
capacity=(--precision 0.05 --capacity)
requests=6000
run mooncake-homogeneous --trace "$mooncake" --max-requests $requests --replicas 16 \
  "${long_slo[@]}" "${capacity[@]}" 1:24
run mooncake-a100-l20 --trace "$mooncake" --max-requests $requests --cluster "$here/a100-l20.yaml" \
  "${long_slo[@]}" "${capacity[@]}" 1:24
run mooncake-two-slowed --trace "$mooncake" --max-requests $requests \
  --cluster "$here/two-slowed.yaml" "${long_slo[@]}" "${capacity[@]}" 1:24
run azure-code-h100-a100-l20 --trace "$traces/AzureLLMInferenceTrace_code.csv" \
  --max-requests $requests --cluster "$here/h100-a100-l20.yaml" \
  --slo-ttft-ms 500 --slo-ttft-per-1k-ms 100 --slo-tpot-ms 50 "${capacity[@]}" 2:200
run arxiv-homogeneous --trace "$traces/vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv" \
  --max-requests $requests --rate 4 --replicas 16 "${long_slo[@]}" "${capacity[@]}" 1:64
# held out: no parameter was chosen on arXiv lengths on this fleet
run arxiv-a100-l20 --trace "$traces/vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv" \
  --max-requests $requests --rate 4 --cluster "$here/a100-l20.yaml" "${long_slo[@]}" \
  "${capacity[@]}" 1:64
# the synthetic scenario mix (--workload mix: chat turns, retrieval-augmented answers,
# long-document summaries; no shared prefix), the default SLOs (2 s TTFT, 100 ms TPOT)
run mix-homogeneous --workload mix --max-requests $requests --replicas 8 "${capacity[@]}" 1:128
run mix-a100-l20 --workload mix --max-requests $requests --cluster "$here/a100-l20.yaml" \
  "${capacity[@]}" 1:128
# a burst at twice the best capacity found on the homogeneous fleet: goodput and SLO
# attainment at one rate
burst=$("$root/.venv/bin/python" -c "import json, sys
found = json.load(open(sys.argv[1]))['policies']
print(round(2 * max(p['capacity_rps'] or 0 for p in found), 1))" "$out/mooncake-homogeneous.json")
run mooncake-homogeneous-2x --trace "$mooncake" --max-requests $requests --replicas 16 \
  "${long_slo[@]}" --rate "$burst"

#!/bin/bash
# Reproduce the README's drill figures: four `isocost engine` processes (ports 8101-8104,
# 5x faster than an H100), `isocost serve` on 8100 with docs/drills/gateway.yaml, one
# `isocost drill --json` against replica 8101 (TARGET=auto: the replica the policy prefers),
# then everything it started is stopped (a restarted engine too).
#   usage: docs/drills/run.sh FAULT [POLICY] [FAULT_SECONDS]   (extra drill flags: DRILL_ARGS,
#          output tokens per request: MAX_TOKENS, default 192)
#   e.g.   docs/drills/run.sh kill;  TARGET=auto docs/drills/run.sh slow equal_cost 5
set -u
here=$(cd "$(dirname "$0")" && pwd)
B=${ISOCOST:-$here/../../.venv/bin/isocost}
out=${OUT:-$(mktemp -d)}
export ISOCOST_ADMIN_TOKEN=drill-admin-token
pids=()
for p in 8101 8102 8103 8104; do
  $B engine --port $p --time-scale 0.2 >/dev/null 2>&1 & pids+=($!)
done
sed "s/^policy: .*/policy: ${2:-round_robin}/" "$here/gateway.yaml" > "$out/gateway.yaml"
sleep 3
$B serve --config "$out/gateway.yaml" --port 8100 > "$out/serve.out" 2> "$out/serve.log" & pids+=($!)
for _ in $(seq 50); do grep -q "ready at" "$out/serve.out" && break; sleep 0.2; done
T=${TARGET:-8101}
if [ "$T" = auto ]; then
  T=$(for _ in 1 2 3 4 5; do
        curl -s -D - -o /dev/null -H 'content-type: application/json' \
          -d '{"model":"llama-3.1-8b","prompt":"hi","max_tokens":4}' \
          http://127.0.0.1:8100/v1/completions | grep -i x-isocost-replica | cut -d: -f3 | tr -d '\r '
      done | sort | uniq -c | sort -rn | head -1 | awk '{print $2}')
fi
extra=()
[ "$1" = restart ] && extra=(--restart-command "$B engine --port $T --time-scale 0.2")
# shellcheck disable=SC2086  # DRILL_ARGS is a list of flags
$B drill --gateway http://127.0.0.1:8100 --replica-admin "http://127.0.0.1:$T" --fault "$1" \
  ${DRILL_ARGS:-} --rate 16 --max-tokens "${MAX_TOKENS:-192}" --warmup 2 --fault-duration "${3:-3}" "${extra[@]}" \
  --json > "$out/$1.json"
echo "exit $?; report: $out/$1.json" >&2
for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
wait 2>/dev/null
left=$(ss -ltnp 2>/dev/null | grep ":$T " | grep -o 'pid=[0-9]*' | cut -d= -f2)
[ -n "$left" ] && kill "$left"  # the restarted engine
cat "$out/$1.json"

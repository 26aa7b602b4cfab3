#!/bin/bash
# The MoE copies at serving batch (issue 33, part 4), on one H200, logs and JSONs to $OUT:
#   bench:  bench_oproj.py --xmoe (consumer stage, xmoe 0 vs 2, TP 8, 8..1024 rows)
#   decode: launch/decode.py at TP 8, --requests 8 / 128 / 256, --xmoe 0 then 2, back to back
# Usage (from the project root, inside .dev/enter.sh on the GPU machine):
#   bash scripts/measure_xmoe.sh bench|decode|all
set -uo pipefail
out=${OUT:-/tmp/xmoe}
mkdir -p "$out"
what=${1:-all}
if [[ $what == bench || $what == all ]]; then
  python3 scripts/bench_oproj.py --xmoe --tp 8 --row-counts 8 32 128 256 1024 --reps 2 \
    --iters 10 --repeats 5 --json "$out/xmoe_rows_tp8.json" 2>&1 | tee "$out/bench_xmoe.log"
fi
if [[ $what == decode || $what == all ]]; then
  for requests in 8 128 256; do
    for xmoe in 0 2; do
      name=decode_r${requests}_x${xmoe}
      python3 launch/decode.py --tp 8 --heads 96 --hidden 7168 --requests "$requests" \
        --tokens 1 --blocks 8 --check-every 0 --xmoe "$xmoe" --json "$out/$name.json" \
        >"$out/$name.log" 2>&1
      rc=$?
      echo "$name: rc $rc | step: $(grep -A1 '^latency' "$out/$name.log" | tail -1)"
      echo "    stages: $(grep -A1 '^breakdown' "$out/$name.log" | tail -1)"
    done
  done
fi

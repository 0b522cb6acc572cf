#!/usr/bin/env bash
# Lab: the driver's peak device memory (card free polled every 5 ms, plus the CUDA context) while serving a
# 4,096-token prompt and 256 generated tokens, for stock mlx-lm and od-moe at 12.5, 25 and 50% of experts,
# on the shapes build_shapes.sh built, beside what `inspect` predicts. One JSON line per run in OUT.
# Usage: PYTHONPATH=/tmp/site lab/device_memory/predict_vs_driver.sh OUT [SHAPE...]
set -uo pipefail
out=$1; shift
for shape in "${@:-deepseek-v2-lite qwen3-30b-a3b}"; do
  for s in $shape; do
    M=/tmp/rs/$s
    timeout 200 python3 lab/device_memory/measure.py stock $M 256 4096 2>&1 | tail -1 | sed "s/^{/{\"shape\": \"$s\", /" >> $out
    for cap in 12.5% 25% 50%; do
        timeout 240 python3 lab/device_memory/measure.py run $M $cap 256 4096 2>&1 | tail -1 | sed "s/^{/{\"shape\": \"$s\", /" >> $out
    done
  done
done
python3 - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        print("not json:", line[:300]); continue
    peak = r.get("driver_peak_with_context", {})
    print(r.get("shape"), "stock" if r.get("stock") else r.get("capacity_asked"), {k: round(v / 1e9, 3) for k, v in peak.items()},
          "inspect:", r.get("inspect", {}).get("device_prediction"), r.get("error", "")[:200])
PY

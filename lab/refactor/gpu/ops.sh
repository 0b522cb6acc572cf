#!/usr/bin/env bash
# Usage: ops.sh  operations a decoded token, each side's lab/tools/op_count.py on the Qwen3-30B-A3B shape at
# lru:0.25 (stock beside it), one process each. Output: $OUT/ops_SIDE.txt, log.txt.
set -u
q30=$(cd /tmp && PYTHONPATH=/tmp/new:/tmp/site python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', 'qwen3-30b-a3b', None))")
for side in old new; do
    (cd /tmp && PYTHONPATH=/tmp/$side:/tmp/site timeout 300 python3 /tmp/bench_$side/op_count.py "$q30" lru:0.25) >"$OUT/ops_$side.txt" 2>&1
    echo "ops $side rc $?: $(grep -i "operations" "$OUT/ops_$side.txt" | head -3 | tr '\n' ' ')" | tee -a "$OUT/log.txt"
done

#!/usr/bin/env bash
# Usage: memory.sh SHAPE DEVICE HOST: od-moe generate past the host's memory on /tmp/rs's SHAPE (q30, next24 or bw),
# DEVICE experts a layer in device slots and a --memory-budget sized for HOST in the host tier (inspect's
# expert bytes x layers x HOST), direct I/O on, 64 tokens, run under lab/three_tiers/within_budget.py (resident
# set and page cache against that budget; the checkpoint dropped from the page cache first). Output:
# $OUT/memory-SHAPE-HOST.json and .txt.
set -u
shape=$1; device=$2; host=$3
export PYTHONPATH=$PWD:/tmp/site
case $shape in q30) name=qwen3-30b-a3b layers=None ;; next24) name=qwen3-next-80b-a3b layers=24 ;;
    *) name=bundled-real-widths layers=None ;; esac
model=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', '$name', $layers))")
budget=$(python3 -m od_moe inspect "$model" --json | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['moe_layers'] * d['expert_bytes'] * $host + 2**20)")
python3 -m od_moe inspect "$model" --memory-budget "$budget" --capacity "$device" | tee "$OUT/memory-$shape-$host.txt"
prompt="Write a Python function that parses a CSV file and returns the rows as dictionaries."
t=$(date +%s)
timeout 400 python3 lab/three_tiers/within_budget.py --budget "$budget" --files "$model" --json "$OUT/memory-$shape-$host.json" -- \
    python3 -m od_moe generate --model "$model" --prompt "$prompt" --max-tokens 64 --capacity "$device" \
    --memory-budget "$budget" --direct-io on --stats >>"$OUT/memory-$shape-$host.txt" 2>&1
echo "memory $shape $host rc $? $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
tail -30 "$OUT/memory-$shape-$host.txt"

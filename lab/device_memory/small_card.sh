#!/usr/bin/env bash
# Lab: od-moe on a card smaller than the model. Builds the Qwen3-30B-A3B shape if absent, then for each
# free size another process (PyTorch) holds the rest of the card while od-moe, given no capacity, runs
# inspect, generate (24 tokens, --stats) and a 4,096-token prompt with 256 generated (measure.py).
# Usage (after install.sh, PYTHONPATH=/tmp/site): lab/device_memory/small_card.sh OUT_DIR 13 8 24
set -uo pipefail
out=$1; shift
M=/tmp/rs/qwen3-30b-a3b
[ -f $M/config.json ] || python3 -c "from od_moe.bench.real_shapes import build_shape; build_shape('qwen3-30b-a3b', '$M', threads=8)" >/dev/null
for free in "$@"; do
    rm -f /tmp/hold.json
    python3 lab/device_memory/measure.py hold "$free" > /tmp/hold.json & hold=$!
    until grep -q free_now /tmp/hold.json 2>/dev/null; do sleep 1; done
    echo "== $free GB free: $(cat /tmp/hold.json)"
    nvidia-smi --query-gpu=memory.used,memory.free --format=csv,noheader
    python3 -m od_moe inspect $M | grep -E "^(device|host|budget|mode) "
    timeout 240 python3 -m od_moe generate --model $M --prompt "def fib(n):" --max-tokens 24 --stats 2>&1 | grep -v Warning | tail -4
    echo "rc=$?"
    timeout 300 python3 lab/device_memory/measure.py run $M auto 256 4096 2>&1 | tail -2 | tee -a "$out/small_card.jsonl"
    kill $hold; wait $hold 2>/dev/null; rm -f /tmp/hold.json
done

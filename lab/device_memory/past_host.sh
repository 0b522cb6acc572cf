#!/usr/bin/env bash
# Lab: where host memory cannot hold every expert (emulated with a host budget, --memory-budget on CUDA),
# which path runs, how fast, and what od-moe says. Qwen3-30B-A3B shape, built if absent.
# Usage (after install.sh, PYTHONPATH=/tmp/site): lab/device_memory/past_host.sh
set -uo pipefail
M=/tmp/rs/qwen3-30b-a3b
[ -f $M/config.json ] || python3 -c "from od_moe.bench.real_shapes import build_shape; build_shape('qwen3-30b-a3b', '$M', threads=8)" >/dev/null
python3 -m od_moe inspect $M --memory-budget 8GB | grep -E "^(mode|host|device) "
for io in off on; do
    echo "== --memory-budget 8GB --capacity 25% --direct-io $io"
    timeout 240 python3 -m od_moe generate --model $M --memory-budget 8GB --capacity 25% --direct-io $io \
        --prompt "def fib(n):" --max-tokens 24 --stats 2>&1 | grep -v -E "^\||Warning" | tail -6
done
echo "== the same, two tiers (host memory holds the experts)"
timeout 240 python3 -m od_moe generate --model $M --capacity 25% --prompt "def fib(n):" --max-tokens 24 --stats \
    2>&1 | grep -v -E "^\||Warning" | tail -3

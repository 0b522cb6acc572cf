#!/usr/bin/env bash
# Lab: real shapes build_shapes.sh built, at 25% of experts on the device against stock mlx-lm in the same
# process (`od-moe bench --shape ... --two-tier`: tokens compared to stock's), one round.
# Usage: PYTHONPATH=/tmp/site lab/device_memory/exact_shapes.sh [NAME[:LAYERS] ...] (default: all five)
set -uo pipefail
shapes=${*:-deepseek-v2-lite qwen3-30b-a3b gpt-oss-20b:4 mixtral-8x7b:4 qwen3-next-80b-a3b:4}
for s in $shapes; do
    name=${s%%:*}; layers=$([ "$name" != "$s" ] && echo ${s#*:})
    echo "== $name ${layers:+($layers layers)}"
    timeout 400 python3 -m od_moe bench --shape $name ${layers:+--shape-layers $layers} --workdir /tmp/rs \
        --two-tier --capacities 0.25 --rounds 1 --max-tokens 16 2>&1 | grep -v Warning | tail -4
done

#!/usr/bin/env bash
# Lab: every real shape build_shapes.sh built, at 25% of experts on the device against stock mlx-lm in the
# same process (`od-moe bench --shape ... --two-tier`: tokens compared to stock's), one round.
# Usage: PYTHONPATH=/tmp/site lab/device_memory/exact_shapes.sh
set -uo pipefail
run() {  # NAME [LAYERS]
    echo "== $1 ${2:+($2 layers)}"
    timeout 300 python3 -m od_moe bench --shape $1 ${2:+--shape-layers $2} --workdir /tmp/rs --two-tier \
        --capacities 0.25 --rounds 1 --max-tokens 16 2>&1 | grep -v Warning | tail -8
}
run deepseek-v2-lite
run qwen3-30b-a3b
run gpt-oss-20b 4
run mixtral-8x7b 4
run qwen3-next-80b-a3b 4

#!/usr/bin/env bash
# Lab: what the driver counts for od-moe at 25% on the Qwen3-30B-A3B shape after a 4k-token prompt, with
# MLX's CUDA graph cache as it is (400 graphs), at 4 graphs, and with CUDA graphs off (attribute.py).
# Usage: PYTHONPATH=/tmp/site lab/device_memory/graphs.sh
set -uo pipefail
M=/tmp/rs/qwen3-30b-a3b
for env in "X=1" "MLX_CUDA_GRAPH_CACHE_SIZE=4" "MLX_USE_CUDA_GRAPHS=0"; do
    echo "== $env"
    env $env timeout 200 python3 lab/device_memory/attribute.py od $M 25% 2>&1 | grep -v Warn | tail -6
done

#!/usr/bin/env bash
# Call 2 (carries .whl/b): MLX (mlx-cuda-13 from its two parts, mlx, mlx-lm) into /tmp/site, then the
# Qwen3-30B-A3B shape and the bundled model at real widths built into /tmp/rs by this checkout's
# real_shapes, then the bundled model at real widths: all in host memory, and device 16 + host 8 of 64
# demand-only and reading ahead (2 rounds).
set -euo pipefail
cat /tmp/w/mlxcuda.part.aa .whl/b/mlxcuda.part.ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .whl/b/*.whl
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import mlx.core as mx, od_moe; print(mx.__version__, mx.default_device(), od_moe.__file__)" | tee -a "$OUT/log.txt"
t=$(date +%s); lab/device_memory/build_some.sh qwen3-30b-a3b bundled-real-widths | tee -a "$OUT/log.txt"; echo "build $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
ROUNDS=2 lab/three_tiers/gpu/rows.sh bw bw tt:0.25,tt:0.25:host=8:disk=none,tt:0.25:host=8

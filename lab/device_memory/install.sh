#!/usr/bin/env bash
# Lab: install MLX's CUDA backend and od-moe into /tmp/site on a device machine from the wheels carried in
# .whl/b (part two of mlx-cuda-13's wheel, split in two because a call carries 64 MiB; part one was copied
# to /tmp/w by the call before). Then od-moe runs with PYTHONPATH=/tmp/site.
set -euo pipefail
cat /tmp/w/mlxcuda.part.aa .whl/b/mlxcuda.part.ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .whl/b/*.whl
rm -rf build /tmp/site/od_moe /tmp/site/od_moe-*  # a build/ kept from an earlier call holds older files
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
PYTHONPATH=/tmp/site python3 -c "import mlx.core as mx, od_moe; print(mx.__version__, mx.default_device(), od_moe.memory.backend.device_memory(), od_moe.memory.backend.limit_device_memory)"

#!/usr/bin/env bash
# Call 2 (carries .whl/b): MLX (mlx-cuda-13 from its two parts, mlx, mlx-lm) into /tmp/site, each side
# checked, then the Qwen3-30B-A3B shape and the bundled model at real widths built into /tmp/rs (new side's
# real_shapes; the checkpoints are plain safetensors both sides read).
set -euo pipefail
cat /tmp/w/mlxcuda.part.aa .whl/b/mlxcuda.part.ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .whl/b/*.whl
for s in old new; do (cd /tmp && PYTHONPATH=/tmp/$s:/tmp/site python3 -c "import mlx.core as mx, od_moe; print('$s', mx.__version__, mx.default_device(), od_moe.__file__)"); done | tee -a "$OUT/log.txt"
t=$(date +%s); PYTHONPATH=/tmp/new:/tmp/site lab/device_memory/build_some.sh qwen3-30b-a3b bundled-real-widths | tee -a "$OUT/log.txt"; echo "build $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"

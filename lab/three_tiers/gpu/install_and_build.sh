#!/usr/bin/env bash
# Sourced by setup2.sh and setup2q.sh (carrying .whl/b): MLX (mlx-cuda-13 from its two parts, mlx,
# mlx-lm) into /tmp/site, PYTHONPATH set to this checkout and it, then the shapes named in "$@" built into
# /tmp/rs by this checkout's real_shapes.
cat /tmp/w/mlxcuda.part.aa .whl/b/mlxcuda.part.ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .whl/b/*.whl
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import mlx.core as mx, od_moe; print(mx.__version__, mx.default_device(), od_moe.__file__)" | tee -a "$OUT/log.txt"
t=$(date +%s); lab/device_memory/build_some.sh "$@" | tee -a "$OUT/log.txt"; echo "build $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"

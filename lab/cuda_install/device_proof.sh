#!/usr/bin/env bash
# Lab: `pip install 'od-moe[cuda13]'` as the one install command on a CUDA machine with no internet. A fresh
# virtual environment that sees the machine's own packages (a .pth file) (its PyTorch brings NVIDIA's CUDA 13 libraries,
# which mlx-cuda-13 requires; the whole bundle, download_wheels.sh, is 2.1 GB, more than a device call
# carries), the wheels of MLX, mlx-cuda-13 (split in two: part one copied to /tmp/w by the call before),
# mlx-lm, flask and datasets carried in .whl/b, od-moe's built here from the checkout; then od-moe
# generates on the GPU.
set -euo pipefail
rm -rf /tmp/wh /tmp/venv build && mkdir -p /tmp/wh
cat /tmp/w/mlxcuda.part.aa .whl/b/mlxcuda.part.ab > /tmp/wh/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
cp .whl/b/*.whl /tmp/wh/
python3 -m pip wheel -q --no-deps --no-build-isolation -w /tmp/wh .
python3 -m venv /tmp/venv  # the machine's python3 is itself a venv: its packages join through a .pth file
python3 -c 'import site; print(site.getsitepackages()[0])' > /tmp/venv/lib/python3.12/site-packages/machine.pth
/tmp/venv/bin/python -m pip install -q --no-index --find-links /tmp/wh 'od-moe[cuda13]'
/tmp/venv/bin/python -m pip list 2>/dev/null | grep -i -E "^(mlx|od-moe|nvidia-cublas|nvidia-cuda-runtime)"
cd /tmp
/tmp/venv/bin/python -c "import mlx.core as mx; print(mx.default_device())"
/tmp/venv/bin/od-moe generate --prompt "def fibonacci(n):" --max-tokens 16 --capacity 25% --stats

#!/usr/bin/env bash
# Call 1 (carries .whl/a): part one of mlx-cuda-13's wheel to /tmp/w.
set -euo pipefail
mkdir -p /tmp/w && cp .whl/a/mlxcuda.part.aa /tmp/w/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 --version; df -h /tmp | tail -1

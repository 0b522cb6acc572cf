#!/usr/bin/env bash
# Call 2 (carries .whl/b): MLX (mlx-cuda-13 from its two parts, mlx, mlx-lm) into /tmp/site, then the
# Qwen3-30B-A3B shape and the bundled model at real widths built into /tmp/rs by this checkout's
# real_shapes, then the bundled model at real widths: all in host memory, and device 16 + host 8 of 64
# demand-only and reading ahead (2 rounds).
set -euo pipefail
source lab/three_tiers/gpu/install_and_build.sh qwen3-30b-a3b bundled-real-widths
ROUNDS=2 lab/three_tiers/gpu/rows.sh bw bw tt:0.25,tt:0.25:host=8:disk=none,tt:0.25:host=8

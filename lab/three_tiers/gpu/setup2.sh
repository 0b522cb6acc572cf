#!/usr/bin/env bash
# Call 2 (carries .whl/b): MLX (mlx-cuda-13 from its two parts, mlx, mlx-lm) into /tmp/site, then the
# Qwen3-30B-A3B shape and the bundled model at real widths built into /tmp/rs by this checkout's
# real_shapes, then a smoke run of three tiers on the bundled model at real widths (tokens against stock).
set -euo pipefail
cat /tmp/w/mlxcuda.part.aa .whl/b/mlxcuda.part.ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .whl/b/*.whl
export PYTHONPATH=$PWD:/tmp/site
python3 -c "import mlx.core as mx, od_moe; print(mx.__version__, mx.default_device(), od_moe.__file__)" | tee -a "$OUT/log.txt"
t=$(date +%s); lab/device_memory/build_some.sh qwen3-30b-a3b bundled-real-widths | tee -a "$OUT/log.txt"; echo "build $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
bw=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', 'bundled-real-widths', None))")
timeout 200 python3 benchmarks/two_tier.py --model "$bw" --rows tt:0.25,tt:0.25:host=16,tt:0.25:host=8:rerun=flagged \
    --rounds 1 --tokens 16 --direct-io on --json "$OUT/smoke.json" >"$OUT/smoke.txt" 2>"$OUT/smoke.err"; echo "smoke rc $?" | tee -a "$OUT/log.txt"
tail -5 "$OUT/smoke.err"; cat "$OUT/smoke.txt"

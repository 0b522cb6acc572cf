#!/usr/bin/env bash
# Call 1 (carries .whl/a, .whl/d): part one of mlx-cuda-13's wheel to /tmp/w; od-moe at a223b80 into /tmp/old
# and at the #71 commit into /tmp/new (wheels built from `git archive` without od_moe/models, copied here from
# the checkout), each side's benchmarks/two_tier.py and lab/tools/op_count.py beside it in /tmp/bench_SIDE.
set -euo pipefail
mkdir -p /tmp/w && cp .whl/a/mlxcuda.part.aa /tmp/w/
for s in old new; do
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/$s .whl/d/$s/*.whl
    cp -r od_moe/models /tmp/$s/od_moe/models
    mkdir -p /tmp/bench_$s && cp .whl/d/$s/two_tier_bench.py .whl/d/$s/op_count.py /tmp/bench_$s/
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 --version

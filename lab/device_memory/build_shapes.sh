#!/usr/bin/env bash
# Lab: build the real shapes this folder's scripts measure into /tmp/rs, where `od-moe bench --shape NAME
# --workdir /tmp/rs` finds them (kept while the machine is warm): Qwen3-30B-A3B and DeepSeek-V2-Lite whole
# (memory), and the first 4 layers of Qwen3-Next-80B-A3B, Mixtral-8x7B and gpt-oss-20b (exactness; the
# device's 64 GB disk holds no more). Usage, after install.sh: PYTHONPATH=/tmp/site lab/device_memory/build_shapes.sh
set -euo pipefail
build() {  # NAME [LAYERS]
    dest=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', '$1', ${2:-None}))")
    python3 -c "from od_moe.bench.real_shapes import build_shape; build_shape('$1', '$dest', ${2:-None}, threads=8)" >/dev/null
    echo "$1 -> $dest: $(du -sh $dest | cut -f1)"
}
build qwen3-30b-a3b & build deepseek-v2-lite & wait
build qwen3-next-80b-a3b 4 & build mixtral-8x7b 4 & build gpt-oss-20b 4 & wait
df -h /tmp | tail -1

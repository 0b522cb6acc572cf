#!/usr/bin/env bash
# Lab: build the named shapes (NAME or NAME:LAYERS) into /tmp/rs at once, where `od-moe bench --shape NAME
# --workdir /tmp/rs` finds them. Usage: PYTHONPATH=/tmp/site lab/device_memory/build_some.sh qwen3-30b-a3b mixtral-8x7b:4
set -euo pipefail
for s in "$@"; do
    name=${s%%:*}; layers=$([ "$name" != "$s" ] && echo ${s#*:} || echo None)
    (dest=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', '$name', $layers))")
     python3 -c "from od_moe.bench.real_shapes import build_shape; build_shape('$name', '$dest', $layers, threads=6)" >/dev/null
     echo "$s -> $dest: $(du -sh $dest | cut -f1)") &
done
wait

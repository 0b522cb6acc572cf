#!/usr/bin/env bash
# Usage: rows.sh TAG SHAPE ROWS [extra bench args]: benchmarks/two_tier.py on /tmp/rs's SHAPE (q30: the
# Qwen3-30B-A3B shape, bw: the bundled model at real widths) with ROWS, ROUNDS (4) rounds of 32 tokens, direct I/O
# on. Output: $OUT/TAG.json, TAG.txt, TAG.err, log.txt.
set -u
tag=$1; shape=$2; rows=$3; shift 3
export PYTHONPATH=$PWD:/tmp/site
name=$([ "$shape" = q30 ] && echo qwen3-30b-a3b || echo bundled-real-widths)
model=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', '$name', None))")
t=$(date +%s)
timeout 560 python3 benchmarks/two_tier.py --model "$model" --rows "$rows" --rounds ${ROUNDS:-4} --tokens 32 --direct-io on \
    --json "$OUT/$tag.json" "$@" >"$OUT/$tag.txt" 2>"$OUT/$tag.err"
echo "$tag rc $? $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
cat "$OUT/$tag.txt"; grep -v '^{' "$OUT/$tag.err" | tail -5

#!/usr/bin/env bash
# Usage: rows.sh TAG SHAPE ROWS [extra bench args]: benchmarks/two_tier.py on /tmp/rs's SHAPE (q30: the
# Qwen3-30B-A3B shape, q30-24 its first 24 layers, next24: Qwen3-Next-80B-A3B's first 24 layers, bw: the bundled model at real widths) with ROWS, ROUNDS (4) rounds of 32 tokens, direct I/O
# on. Output: $OUT/TAG.json, TAG.txt, TAG.err, log.txt.
set -u
tag=$1; shape=$2; rows=$3; shift 3
export PYTHONPATH=${PYTHONPATH:-$PWD:/tmp/site}
case $shape in q30) name=qwen3-30b-a3b layers=None ;; q30-24) name=qwen3-30b-a3b layers=24 ;; next24) name=qwen3-next-80b-a3b layers=24 ;;
    *) name=bundled-real-widths layers=None ;; esac
model=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', '$name', $layers))")
t=$(date +%s)
timeout ${LIMIT:-560} python3 benchmarks/two_tier.py --model "$model" --rows "$rows" --rounds ${ROUNDS:-4} --tokens 32 --direct-io on \
    --json "$OUT/$tag.json" "$@" >"$OUT/$tag.txt" 2>"$OUT/$tag.err"
echo "$tag rc $? $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
cat "$OUT/$tag.txt"; grep -v '^{' "$OUT/$tag.err" | tail -5

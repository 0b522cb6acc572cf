#!/usr/bin/env bash
# Usage: ab.sh SECONDS SIDE:TAG:SHAPE...  runs SIDE's benchmarks/two_tier.py (old = a223b80, new = #71) on
# /tmp/rs's SHAPE (q30: the Qwen3-30B-A3B shape, bw: the bundled model at real widths), row lru:0.25, 4 rounds
# of 32 tokens, from /tmp (not the checkout), one process each; no run starts once SECONDS (counted from $T0,
# else from now) would be passed by a 150 s run. Output: $OUT/TAG.json, TAG.txt, log.txt.
set -u
T0=${T0:-$(date +%s)}; limit=$1; shift
q30=$(cd /tmp && PYTHONPATH=/tmp/new:/tmp/site python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', 'qwen3-30b-a3b', None))")
bw=$(cd /tmp && PYTHONPATH=/tmp/new:/tmp/site python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', 'bundled-real-widths', None))")
for job in "$@"; do
    IFS=: read -r side tag shape <<<"$job"
    if (( $(date +%s) - T0 + 150 > limit )); then echo "$tag: not started, $(( $(date +%s) - T0 )) s gone" | tee -a "$OUT/log.txt"; continue; fi
    model=$([ "$shape" = q30 ] && echo "$q30" || echo "$bw")
    t=$(date +%s)
    (cd /tmp && PYTHONPATH=/tmp/$side:/tmp/site timeout 400 python3 /tmp/bench_$side/two_tier_bench.py --model "$model" \
        --rows lru:0.25 --rounds 4 --tokens 32 --json "$OUT/$tag.json") >"$OUT/$tag.txt" 2>"$OUT/$tag.err"
    rc=$?
    echo "$tag $side $shape rc $rc $(( $(date +%s) - t )) s (at $(( $(date +%s) - T0 )) s)" | tee -a "$OUT/log.txt"
    python3 -c "
import json; r=json.load(open('$OUT/$tag.json'))
r=r[0] if isinstance(r,list) else r.get('rows',[r])[0]
print('  stock %.2f tok/s, row %.2f tok/s, added %.3f ms/token, x stock %.3f, same %s' % (r['stock_tok_s'], r['tok_s'], 1e3/r['tok_s']-1e3/r['stock_tok_s'], r['x_stock'], r['same_tokens']))" 2>/dev/null | tee -a "$OUT/log.txt"
    [ -s "$OUT/$tag.err" ] || rm -f "$OUT/$tag.err"
done

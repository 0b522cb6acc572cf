#!/usr/bin/env bash
# Call 2 when device time is short (carries .whl/b): MLX into /tmp/site, the Qwen3-30B-A3B shape built
# into /tmp/rs, then its rows (ROWS, default all in host memory and device 32 + host 32 of 128 demand-only
# and reading ahead; ROUNDS (2) rounds of TOKENS (24) tokens, direct I/O, the disk probed 20 s at 16 reads in flight).
set -uo pipefail
source lab/three_tiers/gpu/install_and_build.sh qwen3-30b-a3b
model=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', 'qwen3-30b-a3b', None))")
t=$(date +%s)
timeout $(( 560 - $(date +%s) + T0 )) python3 benchmarks/two_tier.py --model "$model" \
    --rows "${ROWS:-tt:0.25,tt:0.25:host=32:disk=none,tt:0.25:host=32}" --rounds ${ROUNDS:-2} --tokens ${TOKENS:-24} --direct-io on \
    --disk-probe 20 --probe-threads 16 --json "$OUT/q30.json" >"$OUT/q30.txt" 2>"$OUT/q30.err"
echo "q30 rc $? $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
cat "$OUT/q30.txt"; grep -v '^{' "$OUT/q30.err" | tail -5

#!/usr/bin/env bash
# Call 2 (carries .whl/b), after setup1.sh: MLX into /tmp/site, the Qwen3-30B-A3B shape built into /tmp/rs,
# then how a decode pass past the host's memory runs again, at device 32 + host 32 of 128, in one process
# (ROWS; ROUNDS (2) rounds of 32 tokens alternating with stock, direct I/O, the disk probed PROBE (4; 0:
# not) s at each of 1-16 reads in flight; BUDGET (590) s from T0 in all): all in host memory; demand only
# (a miss stops the pass 2 layers on, and it runs again exactly from the first miss, the layers before it
# skipped); runs again flagged (each stopping 2 layers past its next miss, no layer waiting for its
# routing); passes that run on past the first miss reading what each missing layer routed to as found
# (rerun=flagged:stop=0), also with the first 2 layers exact; every layer learning its routing (head=48).
# First (SPANS, none: not) a single expert's read timed by request size (`lab/three_tiers/span_reads.py`).
# Output: $OUT/log.txt, span-reads.txt, reruns.{json,txt,err}.
set -uo pipefail
T0=${T0:-$(date +%s)}
# SHAPE q30 (48 layers) or q30-24 (its first 24: half the build's time)
SHAPE=${SHAPE:-q30}
source lab/three_tiers/gpu/install_and_build.sh qwen3-30b-a3b$([ $SHAPE = q30-24 ] && echo :24)
model=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', 'qwen3-30b-a3b', $([ $SHAPE = q30-24 ] && echo 24 || echo None)))")
if [ "${SPANS:-0,524288,262144,131072}" != none ]; then  # a single expert's read by request size, 16 threads
    timeout 60 python3 lab/three_tiers/span_reads.py "$model" --experts 1,2,4 --draws 20 --threads 16 \
        --spans ${SPANS:-0,524288,262144,131072} 2>&1 | tee "$OUT/span-reads.txt" | tee -a "$OUT/log.txt"
fi
D=tt:0.25:host=32
ROWS=${ROWS:-tt:0.25,$D:disk=none,$D:rerun=flagged,$D:rerun=flagged:stop=0,$D:rerun=flagged:stop=0:head=2,$D:head=48}
probe=(); [ "${PROBE:-4}" != 0 ] && probe=(--disk-probe ${PROBE:-4} --probe-threads 16)
ROUNDS=${ROUNDS:-2} LIMIT=$(( ${BUDGET:-590} - $(date +%s) + T0 )) lab/three_tiers/gpu/rows.sh reruns $SHAPE "$ROWS" \
    "${probe[@]}"

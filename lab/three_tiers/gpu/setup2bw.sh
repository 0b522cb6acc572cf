#!/usr/bin/env bash
# Call 2 (carries .whl/b; T0 set): MLX into /tmp/site, the bundled model at real widths built into /tmp/rs, then
# its rows at device 16 + host 8 of 64 (ROWS; default: all in host memory, demand only, the next-use head's
# eviction, and the shadow network reading 1 and 2 layers ahead with it), ROUNDS (4) rounds, the disk probed
# PROBE (10; 0: not) s at each of 1-16 reads in flight.
set -uo pipefail
source lab/three_tiers/gpu/install_and_build.sh bundled-real-widths
d=tt:0.25:host=8:disk=none
probe=(); [ "${PROBE:-10}" != 0 ] && probe=(--disk-probe ${PROBE:-10} --probe-threads 16)
ROUNDS=${ROUNDS:-4} lab/three_tiers/gpu/rows.sh bw8 bw \
    "${ROWS:-tt:0.25,$d,$d:evict=next-use,$d:forecast=shadow:distance=1:evict=next-use,$d:forecast=shadow:distance=2:evict=next-use}" \
    "${probe[@]}"

#!/usr/bin/env bash
# Usage: before_after.sh SHAPE ROW ROUNDS: the same disk ROW (e.g. tt:0.25:host=32:disk=none) on /tmp/rs's SHAPE
# with the runtime before (`.old/od_moe`: an earlier commit's package from old_package.sh, carried) and after (this checkout),
# alternating process by process ROUNDS times, 1 round of 32 tokens each, direct I/O. Output: $OUT/ba-*.
set -u
shape=$1; row=$2; n=$3
for i in $(seq 1 "$n"); do
    for side in before after; do
        site=$([ $side = before ] && echo "$PWD/.old" || echo "$PWD")
        PYTHONPATH=$site:/tmp/site python3 -P -c "import od_moe; print('$side', od_moe.__file__)" >>"$OUT/log.txt"
        PYTHONPATH=$site:/tmp/site ROUNDS=1 LIMIT=200 lab/three_tiers/gpu/rows.sh "ba-$side-$i" "$shape" "$row"
    done
done

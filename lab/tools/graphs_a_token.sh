#!/usr/bin/env bash
# Lab (issue #56): how many CUDA graphs MLX ends a decoded token, per mode of `lab/tools/kernel_time.py`
# (stock, lru:F, tt:F, ...), each in its own process under Nsight Compute's graph profiling: one
# result row per graph launch over TOKENS decoded tokens. The csv files go to OUT (colons in a mode's name
# become dashes); prints graphs a token and their busy ms a token per mode.
# Usage: PYTHONPATH=/tmp/site lab/tools/graphs_a_token.sh OUT MODEL MODE[,MODE...] [TOKENS]
set -uo pipefail
out=$1; model=$2; modes=$3; tokens=${4:-4}
mkdir -p $out
for mode in ${modes//,/ }; do
  csv=$out/graphs-${mode//:/-}.csv
  TOKENS=$tokens timeout 300 ncu --profile-from-start off --clock-control none --cache-control none \
    --graph-profiling graph --metrics gpu__time_duration.sum --csv \
    python3 lab/tools/kernel_time.py run $mode $model > $csv 2> $csv.err
  rc=$?; rows=$(grep -c '^"[0-9]' $csv)
  echo "$mode (rc $rc): $rows graphs over $tokens tokens, $(python3 -c "print(round($rows / $tokens, 1))") a token"
  python3 lab/tools/kernel_time.py sum $csv $tokens 2>/dev/null | head -1
done

#!/usr/bin/env bash
# Lab (issue #56): where a two-tier row's cost a layer goes, in one device call: the device's time by kernel
# (Nsight Compute's node profiling of TOKENS decoded tokens, stock and each mode, `kernel_time.py`), then
# the host's time by MLX's NVTX ranges (`host_ranges.py`, one process a mode beside stock). Outputs in OUT
# (colons in a mode's name become dashes); prints each summary. KERNELS=REGEX (environment): profile only
# the kernels whose names match, not stock, and skip the host ranges (the kept rows' kernel alone: od_moe).
# Usage: PYTHONPATH=/tmp/site lab/tools/per_layer_cost.sh OUT MODEL MODE[,MODE...] [TOKENS]
set -uo pipefail
out=$1; model=$2; modes=$3; tokens=${4:-4}
mkdir -p $out
only=(); first=stock
if [ -n "${KERNELS:-}" ]; then only=(--kernel-name "regex:$KERNELS"); first=; fi
for mode in $first ${modes//,/ }; do
  csv=$out/kernels-${mode//:/-}.csv
  TOKENS=$tokens timeout 200 ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --graph-profiling node "${only[@]}" \
    python3 lab/tools/kernel_time.py run $mode $model > $csv 2> $csv.err
  echo "== kernels, $mode (rc $?)"
  python3 lab/tools/kernel_time.py sum $csv $tokens > $csv.sum 2>&1
  head -8 $csv.sum; grep -E "^  (no copy|copying):" $csv.sum
done
[ -n "${KERNELS:-}" ] && exit 0
for mode in ${modes//,/ }; do
  txt=$out/host-${mode//:/-}.txt
  NVTX_INJECTION64_PATH=/tmp/libnvtx_sum.so timeout 200 python3 lab/tools/host_ranges.py $model stock,$mode \
    16 > $txt 2>&1
  echo "== host ranges, $mode (rc $?)"
  sed -n '/against stock/,$p' $txt | head -18
done

#!/usr/bin/env bash
# Lab (issue #56): the host's cuts of 29d6869 and 703c510 (a compiled pass's batch indices as constants in
# the lanes' shape) on a device, in one call after `setup_q30.sh OUT .whl/b/before-c56cddb.tar` (which makes
# /tmp/before with c56cddb's model_surgery/switch_over.py, layer_step.py, kept_rows.py and kernels.py): the operations of a
# decoded token, now and before (`op_count.py`, deterministic); decode before and after in one process at each ROW
# (`ab_host_time.py`); a custom kernel's host cost by what it carries (`custom_kernel_host.py`). Outputs in
# OUT; prints each summary. Everything in the foreground: nothing outlives the call.
# Usage: PYTHONPATH=/tmp/site lab/tools/host_cuts.sh OUT MODEL [ROWS (lru:0.25,lru:0.5)] [TOKENS] [ROUNDS]
set -uo pipefail
out=$1; model=$2; rows=${3:-lru:0.25,lru:0.5}; tokens=${4:-48}; rounds=${5:-4}
mkdir -p $out
for side in after before; do
  path=$PYTHONPATH; [ $side = before ] && path=/tmp/before:$PYTHONPATH
  PYTHONPATH=$path timeout 150 python3 lab/tools/op_count.py $model ${rows%%,*} > $out/ops-$side.txt 2>&1
  echo "== operations, $side (rc $?)"; tail -2 $out/ops-$side.txt
done
for row in ${rows//,/ }; do
  timeout 240 python3 -u lab/tools/ab_host_time.py $model $row $tokens $rounds > $out/ab-${row//:/-}.txt 2>&1
  echo "== in one process, $row (rc $?)"; tail -5 $out/ab-${row//:/-}.txt
done
timeout 100 python3 lab/tools/custom_kernel_host.py > $out/custom-kernel-host.txt 2>&1
echo "== custom kernels' host cost (rc $?)"; cat $out/custom-kernel-host.txt

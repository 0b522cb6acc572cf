#!/usr/bin/env bash
# Lab: `benchmarks/two_tier.py` rows before and after a change, in alternating fresh processes on one machine
# (after first). BEFORE is a folder holding the older od_moe package, put ahead of PYTHONPATH (for a change
# to one module: a copy of the installed package with that module replaced). Each process's table and rows
# (json, stderr) go to OUT/rows-SIDE-I.txt; the table lines are printed as they come.
# Usage: [TOKENS=24] PYTHONPATH=/tmp/site lab/tools/rows_before_after.sh OUT BEFORE MODEL ROWS [ROUNDS] [REPEATS] [LIMIT_S]
set -uo pipefail
out=$1; before=$2; model=$3; rows=$4; rounds=${5:-4}; repeats=${6:-1}; limit=${7:-280}
mkdir -p $out
for i in $(seq $repeats); do
  for side in after before; do
    path=$PYTHONPATH; [ $side = before ] && path=$before:$PYTHONPATH
    PYTHONPATH=$path timeout $limit python3 -u benchmarks/two_tier.py --model $model --rows $rows \
      --rounds $rounds --tokens ${TOKENS:-24} > $out/rows-$side-$i.txt 2>&1
    echo "== $side $i (rc $?)"; grep "^| lru\|^| tt\|^| exact\|^| static" $out/rows-$side-$i.txt
  done
done

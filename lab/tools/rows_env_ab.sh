#!/usr/bin/env bash
# Lab: `benchmarks/two_tier.py` rows with and without environment settings (ASSIGNMENTS, e.g.
# "MLX_MAX_MB_PER_BUFFER=100000"), in alternating fresh processes on one machine (with first). Each process's
# table and rows go to OUT/rows-SIDE-I.txt; the table lines are printed as they come.
# Usage: [TOKENS=24] PYTHONPATH=/tmp/site lab/tools/rows_env_ab.sh OUT ASSIGNMENTS MODEL ROWS [ROUNDS] [REPEATS] [LIMIT_S]
set -uo pipefail
out=$1; settings=$2; model=$3; rows=$4; rounds=${5:-4}; repeats=${6:-1}; limit=${7:-280}
mkdir -p $out
for i in $(seq $repeats); do
  for side in with without; do
    set_env=""; [ $side = with ] && set_env=$settings
    env $set_env timeout $limit python3 -u benchmarks/two_tier.py --model $model --rows $rows \
      --rounds $rounds --tokens ${TOKENS:-24} > $out/rows-$side-$i.txt 2>&1
    echo "== $side $i (rc $?)"; grep "^| lru\|^| tt\|^| exact\|^| static" $out/rows-$side-$i.txt
  done
done

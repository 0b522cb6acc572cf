#!/usr/bin/env bash
# Lab (issue #55): the refactor's behaviour on the device, before (a156cef, the reference, unpacked
# into .whl/before by `git archive a156cef od_moe benchmarks predictor training pyproject.toml`) and after
# (this checkout, installed in /tmp/site), in one call: the two-tier grid at 25% on the bundled model and its
# widened copy, and the Qwen3-30B-A3B shape's 25% row (built in /tmp/rs). Raw output under OUT.
# Usage: PYTHONPATH=/tmp/site lab/refactor/before_after.sh OUT [grid|shape]...
set -uo pipefail
out=$1; shift
here=$(pwd)
for what in "${@:-grid shape}"; do
  for side in before after; do
    if [ $side = before ]; then dir=$here/.whl/before; path=$here/.whl/before:/tmp/site; else dir=$here; path=/tmp/site; fi
    if [ $what = grid ]; then
      (cd $dir && PYTHONPATH=$path timeout 280 python3 -m od_moe bench --two-tier --capacities 0.25 --rounds 3 \
        --max-tokens 24 --widened-tokens 24 --workdir /tmp/odb) > $out/grid-$side.log 2>&1
    else
      (cd $dir && PYTHONPATH=$path timeout 200 python3 benchmarks/two_tier.py --model /tmp/rs/qwen3-30b-a3b \
        --rows lru:0.25 --rounds 4 --tokens 24 --json $out/shape-$side.json) > $out/shape-$side.log 2>&1
    fi
    echo "== $what $side (rc $?)"; tail -12 $out/$what-$side.log
  done
done

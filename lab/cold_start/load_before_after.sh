#!/usr/bin/env bash
# Lab (issue #56): `load_profile.py` (the load, then the first token) before and after a change, in
# alternating fresh processes, then seconds from the command to the first token (`command_to_token.py`):
# stock, before, after, alternating. BEFORE is a folder holding the older od_moe package, put ahead of
# PYTHONPATH: `git archive REV od_moe predictor training ':!od_moe/models' | tar -x -C BEFORE`, then move
# BEFORE/predictor and BEFORE/training into BEFORE/od_moe (the install maps them there). The kernels MLX compiles stay cached between processes (MLX_PTX_CACHE_DIR), so only the first
# process pays for them. Outputs in OUT.
# Usage: PYTHONPATH=/tmp/site lab/cold_start/load_before_after.sh OUT MODEL BEFORE [ROUNDS] [load|cold|both]
set -uo pipefail
out=$1; m=$2; before=$3; rounds=${4:-2}; what=${5:-both}
mkdir -p $out
path() { [ $1 = before ] && echo $before:$PYTHONPATH || echo $PYTHONPATH; }
if [ $what != cold ]; then
  for i in $(seq $rounds); do
    for s in before after; do
      PYTHONPATH=$(path $s) timeout 400 python3 -u lab/cold_start/load_profile.py $s $m 25 > $out/profile-$s-$i.txt 2>&1
      grep -h " load \| first token " $out/profile-$s-$i.txt
    done
  done
fi
if [ $what != load ]; then
  for i in $(seq $rounds); do
    for s in stock before after; do
      side=$([ $s = stock ] && echo stock || echo od-moe)
      PYTHONPATH=$(path $s) timeout 300 python3 lab/cold_start/command_to_token.py $side $m $(date +%s.%N) \
        2>/dev/null | tail -1 | sed "s/^{/{\"code\": \"$s\", /" | tee -a $out/cold.jsonl
    done
  done
fi

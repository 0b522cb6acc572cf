#!/usr/bin/env bash
# Lab (issue #56): cold starts on a device, one fresh process each, the checkpoint in the page cache.
# Each run gets its own empty MLX kernel cache (MLX_PTX_CACHE_DIR) unless it says "warm", which reuses the
# one before it. Command to first token (stock, then od-moe at 25%), then the server's first request with
# and without serve's warm-up (`first_request.py`). JSON lines in OUT.
# Usage: PYTHONPATH=/tmp/site lab/cold_start/cold_runs.sh OUT MODEL
set -uo pipefail
out=$1; m=$2
fresh() { export MLX_PTX_CACHE_DIR=/tmp/ptx-cold-$1; rm -rf $MLX_PTX_CACHE_DIR; mkdir -p $MLX_PTX_CACHE_DIR; }
fresh stock; timeout 200 python3 lab/cold_start/command_to_token.py stock $m $(date +%s.%N) | tail -1 >> $out
fresh od; timeout 200 python3 lab/cold_start/command_to_token.py od-moe $m $(date +%s.%N) | tail -1 >> $out
timeout 200 python3 lab/cold_start/command_to_token.py od-moe $m $(date +%s.%N) | tail -1 | sed 's/^{/{"kernels": "warm", /' >> $out
for w in on off; do
  fresh serve-$w; timeout 300 python3 lab/cold_start/first_request.py $w --model $m --capacity 25% 2>&1 | tail -1 >> $out
done
cat $out

#!/usr/bin/env bash
# Lab (issue #56): the server's first request on a device, by warm-up: `on` (serve's: the batch path at
# 1 and --max-batch sequences), `single` (one sequence, serve's before bc106dd) and `off`. The first run
# fills MLX's kernel cache (MLX_PTX_CACHE_DIR); the others find the kernels compiled, so what is left is
# what a process compiles and touches for itself. JSON lines in OUT.
# Usage: PYTHONPATH=/tmp/site lab/cold_start/serve_runs.sh OUT MODEL [ROUNDS]
set -uo pipefail
out=$1; m=$2; rounds=${3:-2}
export MLX_PTX_CACHE_DIR=/tmp/ptx-serve
timeout 300 python3 lab/cold_start/first_request.py on --model $m 2>&1 | tail -1 | sed 's/^{/{"kernels": "none cached", /' >> $out
for i in $(seq $rounds); do
  for w in single on off; do
    timeout 200 python3 lab/cold_start/first_request.py $w --model $m 2>&1 | tail -1 >> $out
  done
done
cat $out

#!/usr/bin/env bash
# Lab: what the card holds for od-moe (the driver's peak in prefill and in decode, and after the request,
# context included) against `inspect`'s card figure, at 12.5 / 25 / 50% of experts, a 4,096-token prompt
# and 256 generated tokens, one fresh process per row; with OLD=1 also the 25% row with MLX bounded at the
# whole device budget as before (speed beside it). One JSON line per run in OUT, then a table.
# Usage: PYTHONPATH=/tmp/site lab/device_memory/card_vs_inspect.sh OUT SHAPE...
set -uo pipefail
out=$1; shift
for s in "$@"; do
  M=/tmp/rs/$s
  for cap in 12.5% 25% 50%; do
    timeout 240 python3 lab/device_memory/measure.py run $M $cap 256 4096 2>&1 | tail -1 | sed "s/^{/{\"shape\": \"$s\", /" >> $out
  done
  if [ "${OLD:-0}" = 1 ]; then
    OLD_LIMIT=1 timeout 240 python3 lab/device_memory/measure.py run $M 25% 256 4096 2>&1 | tail -1 | sed "s/^{/{\"shape\": \"$s\", \"old_limit\": true, /" >> $out
  fi
done
python3 - "$out" <<'PY'
import json, sys
print("shape | capacity | limit | prefill peak | decode peak | after | inspect card | peak/inspect | first token s | prompt tok/s | decode tok/s")
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        print("not json:", line[:300]); continue
    if "error" in r:
        print(r.get("shape"), r.get("capacity_asked"), "ERROR", r["error"][:200]); continue
    p, c = r.get("driver_peak_with_context", {}), r.get("card_bytes_predicted") or 0
    g = lambda v: f"{v / 1e9:.2f}" if v else "-"
    peak = max(p.get("prefill", 0), p.get("decode", 0))
    print(f"{r.get('shape')} | {r.get('capacity_asked')}{' old' if r.get('old_limit') else ''} | {g(r.get('mlx_limit'))} | "
          f"{g(p.get('prefill'))} | {g(p.get('decode'))} | {g(r.get('card_after_with_context'))} | {g(c)} | "
          f"{peak / c - 1:+.1%} | {r.get('first_token_s', 0):.2f} | {r.get('prompt_tps', 0):.0f} | {r.get('gen_tok_s', 0):.1f}" if c else "")
PY

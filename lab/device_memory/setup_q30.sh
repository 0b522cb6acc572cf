#!/usr/bin/env bash
# Lab (issue #56): a fresh device machine made ready in one call after `cp .whl/a/* /tmp/w/` (install.sh):
# od-moe installed into /tmp/site, the Qwen3-30B-A3B shape built into /tmp/rs while the kept rows' kernel is
# checked against its numpy twin, then one short row so that later processes find MLX's kernels compiled.
# BEFORE (optional): what makes /tmp/before, a copy of the installed package with older files: a kernels.py
# (put in two_tier/) or a tar of od_moe/... files laid over it. Outputs in OUT. Also says whether Nsight
# Systems is here. Usage: lab/device_memory/setup_q30.sh OUT [BEFORE]
set -uo pipefail
out=$1; before_kernels=${2:-}
bash lab/device_memory/install.sh > $out/install.txt 2>&1 || { tail -5 $out/install.txt; exit 1; }
export PYTHONPATH=/tmp/site
bash lab/device_memory/build_some.sh qwen3-30b-a3b > $out/build.txt 2>&1 &
python3 lab/tools/kept_rows_check.py check 400 > $out/check.txt 2>&1
python3 lab/tools/kept_rows_check.py time 200 >> $out/check.txt 2>&1
wait
grep -v "^step " $out/check.txt; cat $out/build.txt
if [ -n "$before_kernels" ]; then
  rm -rf /tmp/before && mkdir -p /tmp/before && cp -r /tmp/site/od_moe /tmp/before/
  case $before_kernels in
    *.tar) tar -C /tmp/before -xf $before_kernels && tar -tf $before_kernels | grep "\.py$" ;;
    *) cp $before_kernels /tmp/before/od_moe/two_tier/kernels.py ;;
  esac
fi
echo "nsys: $(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)"
# the NVTX range sums of lab/tools/host_ranges.py: built here where a compiler is, else the one carried
gcc -O2 -shared -fPIC -o /tmp/libnvtx_sum.so lab/tools/nvtx_sum.c -lpthread 2>/dev/null ||
  cp .whl/b/libnvtx_sum.so /tmp/ 2>/dev/null; ls -la /tmp/libnvtx_sum.so
timeout 240 python3 -u benchmarks/two_tier.py --model /tmp/rs/qwen3-30b-a3b --rows lru:0.25 --rounds 1 \
  --tokens 4 > $out/warm-up.txt 2>&1
echo "warm-up rc $?"; grep "^| lru" $out/warm-up.txt

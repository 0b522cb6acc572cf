#!/usr/bin/env bash
# Call 2 (carries .whl/b), after setup1.sh: MLX into /tmp/site, the Qwen3-30B-A3B shape built into /tmp/rs,
# `memory.sh q30 32 32` (od-moe generate in a cgroup at its budget; within_budget.py's timeline says when
# and in which pages memory grows), then one 1,024-token prompt at 32 + 32 profiled
# (`lab/three_tiers/prefill_profile.py`), after a 2,000-token prompt of the bundled model at 16 + 8: where a
# long prompt's time goes past the host's memory.
# Output: $OUT/log.txt, memory-q30-32.*, prefill-profile-bundled.txt, prefill-profile.txt.
set -uo pipefail
source lab/three_tiers/gpu/install_and_build.sh qwen3-30b-a3b
lab/three_tiers/gpu/memory.sh q30 32 32
model=$(python3 -c "from od_moe.bench.real_shapes import default_dest as d; print(d('/tmp/rs', 'qwen3-30b-a3b', None))")
t=$(date +%s)  # the bundled model first (no build; 20 KB experts: a prompt's time there is not the disk's)
timeout 60 python3 lab/three_tiers/prefill_profile.py od_moe/models/tiny-qwen3-moe-4bit tt:0.25:host=8:disk=none \
    --tokens 2000 --top 30 --stacks 20 >"$OUT/prefill-profile-bundled.txt" 2>&1
echo "prefill profile bundled rc $? $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
head -12 "$OUT/prefill-profile-bundled.txt"
t=$(date +%s)
timeout ${PROFILE_LIMIT:-150} python3 lab/three_tiers/prefill_profile.py "$model" tt:0.25:host=32:disk=none \
    --tokens ${PROFILE_TOKENS:-1024} --top 40 --stacks 40 >"$OUT/prefill-profile.txt" 2>&1
echo "prefill profile rc $? $(( $(date +%s) - t )) s" | tee -a "$OUT/log.txt"
head -60 "$OUT/prefill-profile.txt"
